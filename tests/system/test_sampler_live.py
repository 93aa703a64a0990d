"""The NVML sampler against real probes: the stand-in driver's per-process slots play NVML's
per-process memory (the driver's own count: allocations and each context's overhead, which the
probes do not see), and CONVGPU_STANDIN_FREE_MS makes cuMemFree_v2 keep its bytes for a while,
as a large free does on the H100 while BPF has already settled it at its entry.
In-process enforcer on the stand-in, real cgroups."""
import sys
from pathlib import Path

import pytest

from conftest import GiB, MiB, StandinNvml, inprocess_enforcer, serving, until

sys.path.append(str(Path(__file__).resolve().parents[2]))
from bench.sched.resume import Worker  # noqa: E402

pytestmark = pytest.mark.system
CTX = 64 * MiB          # what the stand-in driver counts per context; the enforcer charges 0
FREE_MS = 4500          # a free spanning four samples (one a second), and longer than SETTLE_NS


def standin_env(caller_env: dict, free_ms: int) -> dict:
    return dict(caller_env, CONVGPU_STANDIN_CAPACITY=str(16 * GiB), CONVGPU_STANDIN_CTX_OVERHEAD=str(CTX),
                CONVGPU_STANDIN_FREE_MS=str(free_ms))


def enforcer(lib, env):
    """Capacity 4 GiB, limits 3 GiB, no per-context charge: a context is what NVML measures."""
    return inprocess_enforcer(lib, "sampler", 3 * GiB, ctx_overhead=0, nvml=StandinNvml(env["CONVGPU_STANDIN_SHM"]))


def overhead(enf) -> int:
    return enf.status()["containers"][0]["gpus"]["0"]["context_overhead"]


def test_a_waiter_held_by_a_high_reading_is_read_again_and_resumes(root, build, cgroups, caller_env):
    """The H100 case (docs/SCHEDULING.md, "Two stalls that never ended"): samples taken during
    a process's own long free read its freed bytes as context; its next allocation is then
    stalled over its limit. Stopped at that call's entry it is read again (not "in flight"),
    and the next sample gives it back its real context: it resumes within two samples. (With
    stalled calls counted as in flight it stayed stopped for good.)"""
    lib = build / "standin" / "libcuda.so.1"
    env = standin_env(caller_env, FREE_MS)
    w = Worker(cgroups("sampled"), lib, env)      # before the enforcer: the segment exists
    try:
        enf = enforcer(lib, env)
        told = []
        with serving(enf, lambda events: told.extend(e for e in events if e.pid == w.p.pid)):
            w.send(f"a {2 * GiB}")          # the enforcer places the process at this first call
            w.stamp()
            until(lambda: enf.status()["containers"] and overhead(enf) == CTX, 5,
                  "the sampler never measured the context")
            # free the 2 GiB (the stand-in keeps them FREE_MS) and allocate them again at once
            w.send("r")
            until(lambda: overhead(enf) == 2 * GiB + CTX, FREE_MS / 1000,
                  "no two samples in a row read the free in progress: the case is not made")
            # its allocation: 2 GiB on top of 2 GiB + CTX of "context" > its 3 GiB limit
            d = w.line(timeout=FREE_MS / 1000 + 3)
            assert d.startswith("d "), d
            # a wait, not over the limit: its own thread's bytes and its context fit (issue 23)
            over = [e for e in told if e.op == "stall"]
            assert len(over) == 1 and over[0].live == 4 * GiB + CTX and over[0].size == 2 * GiB, over
            assert overhead(enf) == CTX       # exact again
            assert [e.op for e in told if e.op in ("unknown", "stall", "over_limit")] == ["unknown", "stall"]
    finally:
        w.kill()


def test_samples_during_frees_still_in_the_driver_are_not_taken_as_context(root, build, cgroups, caller_env):
    """A process frees and allocates 2 GiB back to back, each free 300 ms inside the driver
    after BPF settled it at its entry. Every sample lands within SETTLE_NS of its last change,
    so none is taken, and its context stays exactly what it is (read while it was quiet).
    Without the settle window the samples in its frees read 2 GiB of context."""
    lib = build / "standin" / "libcuda.so.1"
    env = standin_env(caller_env, 300)
    w = Worker(cgroups("freeing"), lib, env)
    try:
        enf = enforcer(lib, env)
        with serving(enf):
            given, sample = [], enf.sampler.sample     # every value the sampler gives out
            enf.sampler.sample = lambda: given.append(sample()) or given[-1]
            w.send(f"a {2 * GiB}")
            w.stamp()
            until(lambda: enf.status()["containers"] and overhead(enf) == CTX, 5,
                  "the sampler never measured the context")
            n = len(given)
            for _ in range(24):              # about 7 s: seven samples, nearly all inside a free
                w.send("r")
                assert w.line(timeout=5).startswith("d ")
            out = [g.get((w.p.pid, 0)) for g in given[n:]]
            assert len(out) >= 5 and set(out) == {(CTX, 0)}, out   # made before the probes: 0 seen
    finally:
        w.kill()
