"""Demo workload (stdlib only, so it also runs inside a bare container): like the ConVGPU
paper's test application, it allocates 128 MiB every few seconds through the driver API of the
given libcuda, holds a few blocks, and frees them again. With --owner PID:START (the
`convgpu trace` that runs the demo) it ends once that process is gone, however it ended.
    python3 demo_worker.py LIBCUDA [--cgroup DIR] [--owner PID:START] [--size BYTES] [--hold N] [--period S]"""
import argparse
import ctypes
import os
import random
import signal
import sys
import time


def owner_alive(tag: str) -> bool:
    """True while the process PID:START runs (no tag: no owner to outlive)."""
    if not tag:
        return True
    pid, _, start = tag.partition(":")
    try:
        with open(f"/proc/{int(pid)}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19] == start
    except (OSError, IndexError, ValueError):
        return False


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("lib")
    ap.add_argument("--cgroup", help="cgroup directory to join first")
    ap.add_argument("--size", type=int, default=128 << 20)
    ap.add_argument("--hold", type=int, default=3)
    ap.add_argument("--period", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=os.getpid())
    ap.add_argument("--owner", default="", help="PID:START of the process whose demo this is")
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    if a.cgroup:   # started by the owner itself: the kernel tells us at once when it dies
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)   # PR_SET_PDEATHSIG
        with open(os.path.join(a.cgroup, "cgroup.procs"), "w") as f:
            f.write("0")            # "0" moves the writer itself, before any CUDA call
    if not owner_alive(a.owner):    # gone before the line above: nobody would stop us
        return 0
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
    while owner_alive(a.owner):
        if len(held) < a.hold and rng.random() < 0.7:
            p = u64()
            if cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(a.size)) == 0:
                held.append(p.value)
        elif held:
            cu.cuMemFree_v2(held.pop(rng.randrange(len(held))))
        nap = time.monotonic() + a.period * rng.uniform(0.5, 1.5)
        while time.monotonic() < nap and owner_alive(a.owner):   # ends within 0.2 s of the owner
            time.sleep(min(0.2, max(0.0, nap - time.monotonic())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
