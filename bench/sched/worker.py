"""A CUDA process for bench/sched/resume.py, driven by stdin lines (one command a line):

    a SIZE       allocate SIZE bytes; then print "t NS" (CLOCK_MONOTONIC, after the call returned)
    f            print "t NS" (before the call), then free the last allocation; print "ok NS"
                 (after it returned)
    r            free the last allocation, allocate its size again, timed: print "d NS" (how
                 long the allocation itself takes on this driver, with nothing in its way)
    x            print "t NS", then exit at once (os._exit: the process ends right there)
    h SIZE       hold SIZE bytes of host memory, every page touched (its exit then takes longer:
                 the kernel unmaps it before it closes the files, where the driver frees); "ok"
    l RATE SECS SIZE   allocate+free RATE times a second for SECS s, paced every 10 ms;
                 print "done ALLOCS SECONDS"

Run as `python3 -S worker.py LIBCUDA`: plain ctypes, no package import, so it starts in tens of
milliseconds and runs unchanged on the real driver (the GPU machine). It brings up its context
before its first command, then prints "up"."""
import ctypes
import os
import sys
import time

cu = ctypes.CDLL(sys.argv[1])


def ck(what, r):
    if r != 0:
        print(f"error {what} {r}", file=sys.stderr, flush=True)
        os._exit(2)


ck("cuInit", cu.cuInit(0))
dev, ctx = ctypes.c_int(), ctypes.c_void_p()
ck("cuDeviceGet", cu.cuDeviceGet(ctypes.byref(dev), 0))
ck("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))
ck("cuCtxSetCurrent", cu.cuCtxSetCurrent(ctx))
alloc, free = cu.cuMemAlloc_v2, cu.cuMemFree_v2
alloc.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
free.argtypes = [ctypes.c_uint64]
held = []
print("up", flush=True)
for line in sys.stdin:
    cmd = line.split()
    if cmd[0] == "a":
        p = ctypes.c_uint64()
        ck("cuMemAlloc_v2", alloc(ctypes.byref(p), int(cmd[1])))
        print(f"t {time.monotonic_ns()}", flush=True)
        held.append((p.value, int(cmd[1])))
    elif cmd[0] == "f":
        print(f"t {time.monotonic_ns()}", flush=True)
        ck("cuMemFree_v2", free(held.pop()[0]))
        print(f"ok {time.monotonic_ns()}", flush=True)
    elif cmd[0] == "r":
        p, (addr, size) = ctypes.c_uint64(), held.pop()
        ck("cuMemFree_v2", free(addr))
        t = time.monotonic_ns()
        ck("cuMemAlloc_v2", alloc(ctypes.byref(p), size))
        print(f"d {time.monotonic_ns() - t}", flush=True)
        held.append((p.value, size))
    elif cmd[0] == "h":
        host = bytearray(b"\1" * int(cmd[1]))
        print("ok", flush=True)
    elif cmd[0] == "x":
        print(f"t {time.monotonic_ns()}", flush=True)
        os._exit(0)
    elif cmd[0] == "l":
        rate, secs, size = float(cmd[1]), float(cmd[2]), int(cmd[3])
        per_tick, n, p = rate / 100, 0, ctypes.c_uint64()
        start, owed = time.monotonic(), 0.0
        for k in range(1, round(secs * 100) + 1):
            owed += per_tick
            while owed >= 1:
                ck("cuMemAlloc_v2", alloc(ctypes.byref(p), size))
                ck("cuMemFree_v2", free(p.value))
                n += 1
                owed -= 1
            time.sleep(max(0.0, start + k / 100 - time.monotonic()))
        print(f"done {n} {time.monotonic() - start:.3f}", flush=True)
