"""Issue 47, finding 3: a context limit is the context's. The driver keeps cuCtxSetLimit per
context, and each context's limit takes its own bytes; the books charged one limit a process
and GPU. Four cuCtxCreate contexts with a 200 MiB heap each: the driver held 768 MiB while
`status` said `used 192 MiB` (with a stack limit on an H200 each extra context is ~16 GiB).

The tenant (as `nobody`, in a cgroup of its own) runs `cgcaller ctxlimit`: four contexts made,
then each given a 200 MiB heap (200 - 8 MiB above the default: 192 MiB each, in the stand-in's
per-process slot, which the stand-in NVML reports). Now the books say what the driver holds,
each context's limit goes with that context, and under a limit that fits one but not two the
second context's limit call is held at the call (nothing taken), until the limit is raised."""
import pytest

from conftest import MiB, StandinNvml, popen_in, until, wait_state
from shim_attack import NOBODY, enforcer, expect, say

pytestmark = pytest.mark.system
HEAP = 200 * MiB
EACH = HEAP - 8 * MiB           # above the default heap, per context


def tenant(cgroups, build, env, name):
    return popen_in(cgroups(name), *NOBODY, build / "cgcaller", "ctxlimit", "-n", 4, "-s", HEAP, "--limit", "heap",
                    "--hold", "--hold-freed", env=env)


def used(enf, name):
    st = enf.ctl(cmd="status")["status"]
    return next((c["gpus"]["0"]["used"] for c in st["containers"] if c["name"] == name), None)


def test_row47_3_four_contexts_are_charged_four_limits_and_one_destroyed_gives_one_back(cgroups, build, env5):
    enf = enforcer(build, "--gpu-memory", "4GiB", "--limit", "ctxs=1GiB")
    slots = StandinNvml(env5["CONVGPU_STANDIN_SHM"])
    t = None
    try:
        t = tenant(cgroups, build, env5, "ctxs")
        assert expect(t, "allocated", timeout=20)[1:3] == ["4", str(4 * HEAP)]
        assert slots.process_memory()[(t.pid, 0)] == 4 * EACH           # the driver: 768 MiB
        assert used(enf, "ctxs") == 4 * EACH                             # before: 192 MiB
        say(t)                                                           # the first context destroyed
        assert expect(t, "freed", timeout=20)[1:3] == ["1", str(HEAP)]
        assert slots.process_memory()[(t.pid, 0)] == 3 * EACH
        until(lambda: used(enf, "ctxs") == 3 * EACH, 5, f"one context's limit given back: {used(enf, 'ctxs')}")
        say(t)
        assert t.wait(timeout=20) == 0
        until(lambda: used(enf, "ctxs") in (None, 0), 10, "the exit gave the other three back")
    finally:
        if t and t.poll() is None:
            t.kill()
            t.wait()
        enf.close()


def test_row47_3_the_second_contexts_limit_is_held_at_the_call(cgroups, build, env5):
    """300 MiB fits one context's 192 MiB, not two: the second cuCtxSetLimit stops before the
    driver takes anything, and runs once the limit is raised."""
    enf = enforcer(build, "--gpu-memory", "4GiB", "--limit", "tight=300MiB")
    slots = StandinNvml(env5["CONVGPU_STANDIN_SHM"])
    t = None
    try:
        t = tenant(cgroups, build, env5, "tight")
        wait_state(t.pid, "T", timeout=20)
        enf.wait_for(f"stall tight pid {t.pid} on GPU0: cuCtxSetLimit {EACH / MiB:.1f} MiB")
        assert slots.process_memory()[(t.pid, 0)] == EACH               # the first, not the second
        assert used(enf, "tight") == EACH
        enf.cli("limit", "set", "tight", "1GiB")
        assert expect(t, "allocated", timeout=20)[1:3] == ["4", str(4 * HEAP)]
        assert slots.process_memory()[(t.pid, 0)] == 4 * EACH
        assert used(enf, "tight") == 4 * EACH
    finally:
        if t and t.poll() is None:
            t.kill()
            t.wait()
        enf.close()
