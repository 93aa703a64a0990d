"""Issue 33, attack 3: CUDA arrays were accounted at their return but never admitted at their
entry, so 8 x cuArray3DCreate_v2 of 512 MiB took 4,096 MiB under a 256 MiB limit, never
stopped. Now every call that obtains device memory is admitted at its entry with its size
(bpf/admit.bpf.c admit_call, array_bytes; probes/table.py ADMITTED): the first array, which
can never fit, is stopped (or killed, --over-limit kill) before it runs. Real enforcer on the
stand-in driver; the attacker as nobody in a cgroup of its own, a neighbour in another."""
import pytest

from conftest import GiB, MiB, inprocess_enforcer, read_until, serving, until, wait_state
from failclosed import logged, neighbour_runs, own_lib, python_as_nobody, quiet_logs  # noqa: F401 (fixture)

pytestmark = pytest.mark.system
LIMIT = 256 * MiB
# CUDA_ARRAY3D_DESCRIPTOR {size_t Width, Height, Depth; CUarray_format Format; unsigned
# NumChannels, Flags}: 8192 x 8192 x 8 one-byte texels (CU_AD_FORMAT_UNSIGNED_INT8) = 512 MiB
ARRAYS = """
class D(ctypes.Structure):
    _fields_ = [('w', ctypes.c_size_t), ('h', ctypes.c_size_t), ('d', ctypes.c_size_t),
                ('fmt', ctypes.c_uint), ('nch', ctypes.c_uint), ('flags', ctypes.c_uint)]
desc, a = D(8192, 8192, 8, 0x01, 1, 0), ctypes.c_void_p()
print('context', flush=True)
for i in range(8):
    assert cu.cuArray3DCreate_v2(ctypes.byref(a), ctypes.byref(desc)) == 0
    print('array', i + 1, flush=True)
print('done', flush=True)
sys.stdin.readline()
"""


@pytest.mark.parametrize("over_limit", ["stall", "kill"])
def test_row33_3_an_array_is_admitted_at_its_entry(root, own_lib, cgroups, env5, caplog, over_limit):
    quiet_logs(caplog)
    enf = inprocess_enforcer(own_lib, f"r33-3-{over_limit}", LIMIT,
                             capacity={0: 4 * GiB}, over_limit=over_limit, ctx_overhead=0)
    procs = []
    with serving(enf):
        try:
            attacker = python_as_nobody(cgroups("arrays"), own_lib, env5, ARRAYS)
            procs.append(attacker)
            assert read_until(attacker, "context", timeout=30) == ["context"]
            if over_limit == "kill":
                assert attacker.wait(timeout=20) == -9      # SIGKILL before its first array ran
            else:
                wait_state(attacker.pid, "T")
                until(lambda: any(attacker.pid in c["pids"] for c in enf.status()["containers"]), 10, "not placed")
            # before: "array 1" .. "array 8" and 4,096 MiB held; now not one array ran
            [u] = [u for u in enf.tracer.usage() if u.pid == attacker.pid] or [None]
            assert u is None or (u.n_alloc, u.live) == (0, 0), u
            [line] = logged(caplog, "512.0 MiB", "above its limit 256.0 MiB")
            assert line.endswith(f"pid {attacker.pid} needs 512.0 MiB for its cuArray3DCreate_v2, above its limit "
                                 "256.0 MiB: killed before it ran" if over_limit == "kill"
                                 else "needs 512.0 MiB, above its limit 256.0 MiB: stalled until the limit is raised"), line
            procs.append(neighbour_runs(cgroups("neighbour"), own_lib, env5))
            if over_limit == "stall":
                assert attacker.poll() is None
                [box] = [c for c in enf.status()["containers"] if attacker.pid in c["pids"]]
                assert box["gpus"]["0"]["used"] == 0
        finally:
            for p in procs:
                p.kill()
                p.wait()
