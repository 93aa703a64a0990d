"""One process on two GPUs under the enforcer (stand-in driver with two devices, in-process
enforcer, real probes and cgroups): its first context on the second GPU places it there too,
and what it already holds on the first is not counted a second time."""
import subprocess
import sys

import pytest

from conftest import GiB, MiB, inprocess_enforcer, lines_until, proc_state, serving, until

pytestmark = pytest.mark.system

# 600 MiB on GPU0, a context and 100 MiB on GPU1, then 300 MiB more on GPU0: 900 MiB there,
# under the 1 GiB limit. Counted twice, GPU0 would read 1.5 GiB and stall the last allocation.
SCRIPT = r"""
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
def ok(rc, what):
    if rc:
        sys.exit(f"{what}: {rc}")
ok(lib.cuInit(0), "cuInit")
ctx = [ctypes.c_void_p(), ctypes.c_void_p()]
ptr = ctypes.c_uint64()
def on(dev, mib):
    if not ctx[dev].value:
        ok(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx[dev]), dev), "retain")
    ok(lib.cuCtxSetCurrent(ctx[dev]), "set current")
    ok(lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(mib << 20)), f"alloc {mib} MiB on {dev}")
    print(f"GPU{dev} +{mib}", flush=True)
on(0, 600)
on(1, 100)
on(0, 300)
print("ready", flush=True)
sys.stdin.readline()
"""


def test_a_first_context_on_a_second_gpu_does_not_count_the_first_twice(root, build, cgroups, caller_env):
    lib = str(build / "standin" / "libcuda.so.1")
    enf = inprocess_enforcer(lib, "two", GiB, {0: 4 * GiB, 1: 4 * GiB})
    cg = cgroups("two")
    env = dict(caller_env, CONVGPU_STANDIN_DEVICES="2")
    with serving(enf):
        p = subprocess.Popen(["/bin/sh", "-c", f'echo $$ > {cg}/cgroup.procs && exec "$0" "$@"', sys.executable,
                              "-c", SCRIPT, lib], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        try:
            out: list = []
            lines_until(p.stdout, lambda line: line.strip() == "ready", out, 20, "the two-GPU process")
            assert [x.strip() for x in out] == ["GPU0 +600", "GPU1 +100", "GPU0 +300", "ready"]
            assert proc_state(p.pid) != "T"
            box = next(b for b in enf.boxes.values() if b.name == "two")
            until(lambda: enf._usage(box, 0)[:2] == (900 * MiB, 1), 5, "GPU0's usage settled")
            assert enf._usage(box, 0)[:2] == (900 * MiB, 1) and enf._usage(box, 1)[:2] == (100 * MiB, 1)
            assert box.adopted == {} and box.stalls == 0
        finally:
            p.kill()
            p.wait()
