"""The processes bench.breakdown runs beside itself.

    python -m bench.breakdown_child pairs torch|cupy|driver|runtime SIZE,SIZE,... [HOLD]
    python -m bench.breakdown_child bystander N

`pairs`: the workload. It first allocates HOLD blocks of the first size (default 0) and keeps
them for its life, as a framework keeps its weights: on a real driver the device page then
stays mapped, and each pair is a sub-allocation, not a page mapped and unmapped (77-111 us on
the H100, swamping a few us of probes). After a warm-up of 1,000 pairs it prints `ready PID`;
then for every line K on its stdin it makes K allocation+free pairs (the sizes cycled) and prints
`WALL_NS CPU_NS` (CPU: this thread's user + system time; a trap is system time). torch: tensors
under PYTORCH_NO_CUDA_MEMORY_CACHING=1 (the parent sets it), cupy: arrays without CuPy's pool,
driver: cuMemAlloc_v2/cuMemFree_v2 of $BREAKDOWN_LIBCUDA through ctypes, runtime:
cudaMalloc/cudaFree of $CONVGPU_CUDART.

`bystander`: what every process on the host pays for the tracepoints: N openat+close of
/dev/null, then N/100 fork+exit, each loop timed; prints ns per openat+close and per fork+exit."""
import ctypes
import os
import sys
import time


def _driver():
    cu = ctypes.CDLL(os.environ.get("BREAKDOWN_LIBCUDA", "libcuda.so.1"))
    ctx, dev = ctypes.c_void_p(), ctypes.c_int()
    for rc in (cu.cuInit(0), cu.cuDeviceGet(ctypes.byref(dev), 0),
               cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), cu.cuCtxSetCurrent(ctx)):
        if rc:
            sys.exit(f"driver set-up failed: CUresult {rc}")
    return cu


_held: list = []


def pair_of(kind: str):
    """(the function that makes one allocation of n bytes and frees it, the one that makes one
    and keeps it)."""
    if kind == "torch":
        import torch
        torch.empty(1, device="cuda")
        make = lambda n: torch.empty(n, dtype=torch.uint8, device="cuda")   # noqa: E731
        return make, lambda n: _held.append(make(n))   # a tensor is freed as it is dropped
    if kind == "cupy":
        import cupy
        cupy.cuda.set_allocator(None)
        cupy.empty(1, dtype=cupy.uint8)
        make = lambda n: cupy.empty(n, dtype=cupy.uint8)   # noqa: E731
        return make, lambda n: _held.append(make(n))
    cu = _driver()
    lib, names = (cu, ("cuMemAlloc_v2", "cuMemFree_v2")) if kind == "driver" else \
        (ctypes.CDLL(os.environ["CONVGPU_CUDART"]), ("cudaMalloc", "cudaFree"))
    alloc, free = (getattr(lib, x) for x in names)
    alloc.argtypes, free.argtypes = [ctypes.c_void_p, ctypes.c_size_t], [ctypes.c_uint64]
    ptr = ctypes.c_uint64()
    ref = ctypes.byref(ptr)

    def pair(n):
        if alloc(ref, n) or free(ptr.value):
            sys.exit(f"{names[0]}/{names[1]} failed")

    def keep(n):
        if alloc(ctypes.byref(ctypes.c_uint64()), n):
            sys.exit(f"{names[0]} of a held block failed")
    return pair, keep


def pairs(kind: str, sizes: list[int], hold: int = 0) -> None:
    pair, keep = pair_of(kind)
    for _ in range(hold):
        keep(sizes[0])
    cycle = [sizes[i % len(sizes)] for i in range(1000)]
    for n in cycle:
        pair(n)
    print("ready", os.getpid(), flush=True)
    for line in sys.stdin:
        k = int(line)
        c0, t0 = time.thread_time_ns(), time.monotonic_ns()
        for i in range(k):
            pair(cycle[i % 1000])
        t1, c1 = time.monotonic_ns(), time.thread_time_ns()
        print(t1 - t0, c1 - c0, flush=True)


def bystander(n: int) -> None:
    t0 = time.monotonic_ns()
    for _ in range(n):
        os.close(os.open("/dev/null", os.O_RDONLY))
    t1 = time.monotonic_ns()
    forks = max(1, n // 100)
    for _ in range(forks):
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
    t2 = time.monotonic_ns()
    print((t1 - t0) / n, (t2 - t1) / forks)


if __name__ == "__main__":
    if sys.argv[1] == "pairs":
        pairs(sys.argv[2], [int(x) for x in sys.argv[3].split(",")], int(sys.argv[4]) if len(sys.argv) > 4 else 0)
    else:
        bystander(int(sys.argv[2]))
