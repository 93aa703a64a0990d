"""Demo workload (stdlib only, so it also runs inside a bare container): like the ConVGPU
paper's test application, it allocates 128 MiB every few seconds through the driver API of the
given libcuda, holds a few blocks, and frees them again.
    python3 demo_worker.py LIBCUDA [--cgroup DIR] [--size BYTES] [--hold N] [--period S]"""
import argparse
import ctypes
import os
import random
import signal
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("lib")
    ap.add_argument("--cgroup", help="cgroup directory to join first")
    ap.add_argument("--size", type=int, default=128 << 20)
    ap.add_argument("--hold", type=int, default=3)
    ap.add_argument("--period", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=os.getpid())
    a = ap.parse_args()
    if a.cgroup:
        with open(os.path.join(a.cgroup, "cgroup.procs"), "w") as f:
            f.write("0")            # "0" moves the writer itself, before any CUDA call
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    cu = ctypes.CDLL(a.lib)
    u64 = ctypes.c_uint64

    def check(rc, what):
        if rc:
            raise SystemExit(f"demo worker: {what} failed with CUresult {rc}")

    check(cu.cuInit(0), "cuInit")
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    check(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    check(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    cu.cuMemFree_v2.argtypes = [u64]
    rng = random.Random(a.seed)
    held = []
    while True:
        if len(held) < a.hold and rng.random() < 0.7:
            p = u64()
            if cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(a.size)) == 0:
                held.append(p.value)
        elif held:
            cu.cuMemFree_v2(held.pop(rng.randrange(len(held))))
        time.sleep(a.period * rng.uniform(0.5, 1.5))


if __name__ == "__main__":
    sys.exit(main())
