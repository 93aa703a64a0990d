"""Issue 33, attack 6: under `--stall freezer --over-limit kill` the container's only CUDA
process was killed while it waited, frozen: its box was dropped without a thaw, so
`cgroup.freeze` stayed 1 on the emptied cgroup, and the next process to join it froze, with
nobody left to thaw it. Now a frozen cgroup is thawed when its last process leaves
(enforcer/actuator.py `Actuator.thaw_emptied`), with one log line. Real enforcer on the stand-in driver,
cgroup2 freezer; the tenant as nobody in a cgroup of its own, a neighbour in another."""
import signal
import time

import pytest

from conftest import GiB, MiB, inprocess_enforcer, popen_in, read_until, serving, until
from failclosed import logged, own_lib, python_as_nobody, quiet_logs  # noqa: F401 (fixture)

pytestmark = pytest.mark.system
HOLD = """
p = ctypes.c_uint64()
assert cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t({size})) == 0
print('ready', flush=True)
sys.stdin.readline()
"""


def freeze_of(cg) -> str:
    return (cg / "cgroup.freeze").read_text().strip()


@pytest.mark.parametrize("at", ["alloc", "context"])
def test_row33_6_a_frozen_cgroup_is_thawed_when_its_last_process_leaves(root, own_lib, cgroups, env5, caplog, at):
    """at alloc: the tenant waits at its 400 MiB; at context: at its first context, killed
    before it was ever a process BPF had an entry for (before, its exit was never even told:
    the H100's path, where a context costs 518 MiB)."""
    from convgpu.enforcer.failsafe.stall import make_stopper
    quiet_logs(caplog)
    # 1 GiB card, limits 768 MiB: the neighbour's 600 MiB (its context's 600 MiB and 0 bytes)
    # gets it 768 MiB, the tenant 256 MiB, so the tenant's 400 MiB (its 600 MiB context) waits
    ctx = 600 * MiB if at == "context" else 0
    enf = inprocess_enforcer(own_lib, f"r33-6-{at}", 768 * MiB, capacity={0: 1 * GiB}, over_limit="kill",
                             stopper=make_stopper("freezer-v2"), ctx_overhead=ctx)
    procs = []
    with serving(enf):
        try:
            neighbour = python_as_nobody(cgroups("neighbour"), own_lib, env5,
                                         HOLD.format(size=1 if at == "context" else 600 * MiB))
            procs.append(neighbour)
            assert read_until(neighbour, "ready", timeout=30) == ["ready"]
            cg = cgroups("tenant")
            tenant = python_as_nobody(cg, own_lib, env5, HOLD.format(size=400 * MiB))
            procs.append(tenant)
            until(lambda: freeze_of(cg) == "1", 20, "the tenant's cgroup was not frozen")
            assert logged(caplog, "stall tenant pid", "cuMemAlloc_v2 400.0 MiB" if at == "alloc" else
                          "placed with 256.0 MiB assigned, needs 600.0 MiB")
            tenant.send_signal(signal.SIGKILL)      # its only CUDA process, killed while it waits
            assert tenant.wait(timeout=10) == -9
            # before: cgroup.freeze stayed 1 for good; now thawed as its box goes
            until(lambda: freeze_of(cg) == "0", 10, f"the emptied cgroup stayed frozen: {freeze_of(cg)}")
            [line] = logged(caplog, "container tenant: its last process left while its cgroup", "was frozen: thawed")
            # the next process to join it runs (before: it froze)
            t0 = time.monotonic()
            nxt = popen_in(cg, "/bin/echo", "runs")
            procs.append(nxt)
            assert nxt.communicate(timeout=10)[0] == "runs\n" and time.monotonic() - t0 < 10
            assert neighbour.poll() is None and freeze_of(cgroups("neighbour")) == "0"
        finally:
            for p in procs:
                p.kill()
                p.wait()
