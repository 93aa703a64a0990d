"""Issue 33, attack 2: a process run under a tracer of its own (PTRACE_SEIZE from a child after
prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY), no privilege needed) has every SIGSTOP shown to that
tracer first, which drops it: 2,048 MiB under a 256 MiB limit, 30 stops discarded, and the log
said 32 times "stopped again before its cuMemAlloc_v2 ran", which was false. The enforcer's own
ptrace holder cannot seize a thread already traced (EPERM). Now BPF reads the calling thread's
tracer from the kernel (task_struct offsets from BTF, probes/btf.py; bpf foreign_tracer) on its
way to a stop, and where that stop is the last check before the call's body (the recheck) a
thread traced by another process is killed, which no tracer can swallow; the log says so in
one line. Real enforcer on the stand-in driver; attacker as nobody in a cgroup of its own."""
import pytest

from attack import scratch  # noqa: F401 (fixture)
from conftest import GiB, MiB, inprocess_enforcer, lines_until, serving
from failclosed import allocs, build_swallow, logged, neighbour_runs, own_lib, python_as_nobody, quiet_logs  # noqa: F401

pytestmark = pytest.mark.system
LIMIT = 256 * MiB
ATTACK = allocs(8, 256 * MiB)


def test_row33_2_a_thread_its_own_tracer_would_let_go_is_killed(root, own_lib, cgroups, env5, caplog, scratch):
    quiet_logs(caplog)
    swallow = build_swallow(scratch)
    enf = inprocess_enforcer(own_lib, "r33-2", LIMIT, capacity={0: 4 * GiB}, ctx_overhead=0)
    procs = []
    with serving(enf):
        try:
            attacker = python_as_nobody(cgroups("traced"), own_lib, env5, ATTACK, wrap=(swallow,))
            procs.append(attacker)
            out: list = []
            try:
                lines_until(attacker.stdout, lambda line: line == "done", out, 30, "attacker")
            except AssertionError:
                pass    # it died before "done"
            assert attacker.wait(timeout=30) == -9, out           # SIGKILL: no tracer can drop it
            # before: "alloc 1" .. "alloc 8" and "done": 2,048 MiB under 256 MiB
            allocs = [line for line in out if line.startswith("alloc")]
            assert len(allocs) * 256 * MiB <= LIMIT, out
            [line] = logged(caplog, f"pid {attacker.pid} ", "traced by pid", timeout=60)
            assert "not convgpu, which can swallow a stop" in line and "killed before its" in line, line
            assert not logged(caplog, f"pid {attacker.pid} ", "stopped again", timeout=0.5)
            procs.append(neighbour_runs(cgroups("neighbour"), own_lib, env5))
        finally:
            for p in procs:
                p.kill()
                p.wait()
