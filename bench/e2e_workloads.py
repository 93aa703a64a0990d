"""The long-running workloads of bench.e2e_toggle: one process that trains (or calls the
driver) step after step for minutes while the harness switches the host's mode under it.

    python -m bench.e2e_workloads NAME [--batch N] [--allocs N] [--work N] [--hold N] [--pin CPUS] [--lib PATH]

NAME: `standin` (the stand-in driver through ctypes: `--allocs` cuMemAlloc_v2 + cuMemFree_v2
pairs of 4 KiB and `--work` iterations of Python arithmetic per step, the CPU machine's check;
`--hold N` keeps N blocks of 4 KiB for its whole life),
`torch` (torchvision's ResNet-50 without weights, else a ResNet-50-sized net of our own, SGD on
synthetic 224x224 images; run it with PYTORCH_NO_CUDA_MEMORY_CACHING=1 for the worst case),
`jax` (an MLP's training step under jit; XLA_PYTHON_CLIENT_PREALLOCATE=false is set here).

Protocol (nothing else is written to stdout: the workload's own prints go to stderr): after its
warm-up, one line `ready PID` on stdout, then one line per step, `T_END_NS ALLOCS CPU_NS REF_NS`,
T_END_NS the CLOCK_MONOTONIC end of the step (the harness's clock too), ALLOCS the driver
allocations the workload made itself so far (the stand-in's; 0 where a framework allocates) and
CPU_NS the stepping thread's CPU time (user and system: a uprobe's trap is the thread's system
time), which waiting for a CPU does not stretch (bench.e2e_toggle --clock cpu), and REF_NS the
time of the step's fixed reference work (`reference`, part of the step). A step is the
time from one end to the next, so nothing the loop does falls between steps. The file named by
E2E_CONTROL (8 bytes, mmapped) holds an injected delay in ns that every step busy-waits at its
end: the harness's known truth."""
import argparse
import ctypes
import mmap
import os
import struct
import sys
import time

WARMUP_S = 5.0   # cuDNN's autotuning, jit compiles and the allocator's growth happen before "ready"


class Control:
    """The harness's injected delay, read once per step (a mmapped integer: no syscall)."""

    def __init__(self, path: str | None):
        self.mm = None
        if path:
            with open(path, "r+b") as f:
                self.mm = mmap.mmap(f.fileno(), 8)

    def delay_ns(self) -> int:
        return struct.unpack_from("<q", self.mm, 0)[0] if self.mm else 0


REF_ITERS = 4000


def reference() -> int:
    """A fixed piece of CPU work timed in every step, no driver call in it: the GPU hosts run a
    vCPU at one speed or 1.3-1.85x slower for seconds at a time (docs/BENCHMARKS.md, "The GPU
    machines' CPU regimes"), and a step over its reference is a time at one speed
    (bench/e2e_stats.py: `norm`)."""
    x = 0
    for i in range(REF_ITERS):
        x += i * i
    return x


def spin(ns: int) -> None:
    end = time.monotonic_ns() + ns
    while time.monotonic_ns() < end:
        pass


def standin_step(lib: str, allocs: int, work: int, hold: int = 0):
    cu = ctypes.CDLL(lib)
    ctx, dev, ptr = ctypes.c_void_p(), ctypes.c_int(), ctypes.c_uint64()
    for call in (lambda: cu.cuInit(0), lambda: cu.cuDeviceGet(ctypes.byref(dev), 0),
                 lambda: cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), lambda: cu.cuCtxSetCurrent(ctx)):
        if call() != 0:
            raise SystemExit("the stand-in driver refused its set-up")
    alloc, free, size = cu.cuMemAlloc_v2, cu.cuMemFree_v2, ctypes.c_size_t(4096)
    alloc.argtypes, free.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t], [ctypes.c_uint64]
    ref = ctypes.byref(ptr)
    # held for the process's life: on a real driver an alternating 4 KiB allocation and free with
    # nothing held maps and unmaps a device page every pair (77-111 us, and steps that flip
    # between two speeds for seconds, in bare blocks too: H200, 2026-11-27c run5); with one
    # block held the page stays and each pair is the sub-allocation a framework that holds its
    # weights makes
    for _ in range(hold):
        if alloc(ctypes.byref(ctypes.c_uint64()), size) != 0:
            raise SystemExit("cuMemAlloc_v2 of a held block failed")

    def step() -> int:
        for _ in range(allocs):
            if alloc(ref, size) != 0 or free(ptr.value) != 0:
                raise SystemExit("cuMemAlloc_v2/cuMemFree_v2 failed")
        x = 0
        for i in range(work):
            x += i * i
        return allocs
    return step


def torch_step(batch: int):
    import torch
    from torch import nn
    torch.backends.cudnn.benchmark = True
    try:
        from torchvision.models import resnet50
        model = resnet50(weights=None)
    except ImportError:   # a ResNet-50-sized stand-in: same stem, stages of bottlenecks, head
        model = _resnet50_like(nn)
    model = model.cuda().to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(batch, 3, 224, 224, device="cuda", generator=g).to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (batch,), device="cuda", generator=g)

    def step() -> int:
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()
        torch.cuda.synchronize()   # a step ends when the GPU is done with it
        return 0
    return step


def _resnet50_like(nn):
    def block(cin, mid, stride):
        cout = 4 * mid
        body = nn.Sequential(nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU(),
                             nn.Conv2d(mid, mid, 3, stride, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU(),
                             nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout))
        skip = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.body, self.skip = body, skip

            def forward(self, t):
                return (self.body(t) + self.skip(t)).relu()
        return Block()
    layers, cin = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1)], 64
    for mid, n, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for i in range(n):
            layers.append(block(cin, mid, stride if i == 0 else 1))
            cin = 4 * mid
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 1000))


def jax_step(batch: int):
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax
    import jax.numpy as jnp
    widths = [1024] + [4096] * 6 + [1024]
    key = jax.random.PRNGKey(0)
    params = []
    for a, b in zip(widths, widths[1:]):
        key, k = jax.random.split(key)
        params.append((jax.random.normal(k, (a, b)) / a ** 0.5, jnp.zeros(b)))
    x = jax.random.normal(key, (batch, widths[0]))
    y = jnp.roll(x, 1, axis=1)

    def loss(ps, x, y):
        for w, b in ps[:-1]:
            x = jax.nn.gelu(x @ w + b)
        w, b = ps[-1]
        return jnp.mean((x @ w + b - y) ** 2)

    @jax.jit
    def update(ps, x, y):
        g = jax.grad(loss)(ps, x, y)
        return [(w - 1e-3 * gw, b - 1e-3 * gb) for (w, b), (gw, gb) in zip(ps, g)]
    state = [params]

    def step() -> int:
        state[0] = update(state[0], x, y)
        jax.block_until_ready(state[0])
        return 0
    return step


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("name", choices=("standin", "torch", "jax"))
    ap.add_argument("--batch", type=int, default=0, help="torch 128, jax 8192 when 0")
    ap.add_argument("--allocs", type=int, default=20, help="standin: alloc+free pairs per step")
    ap.add_argument("--work", type=int, default=20000, help="standin: arithmetic iterations per step")
    ap.add_argument("--lib", default="libcuda.so.1", help="standin: the stand-in driver")
    ap.add_argument("--hold", type=int, default=0, help="standin: 4 KiB blocks held for the process's life")
    ap.add_argument("--pin", help="CPUs to run on (e.g. 3 or 2,3): the step's speed stays that CPU's")
    ap.add_argument("--warmup", type=float, default=WARMUP_S, help="seconds of steps before `ready`")
    a = ap.parse_args(argv)
    if a.pin:
        os.sched_setaffinity(0, {int(c) for c in a.pin.split(",")})
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)   # a framework's prints must not mix with the step lines
    if a.name == "standin":
        step = standin_step(a.lib, a.allocs, a.work, a.hold)
    elif a.name == "torch":
        step = torch_step(a.batch or 128)
    else:
        step = jax_step(a.batch or 8192)
    ctl = Control(os.environ.get("E2E_CONTROL"))
    end = time.monotonic() + a.warmup
    while time.monotonic() < end:
        step()
    out.write(f"ready {os.getpid()}\n")
    allocs, write, cpu, clock = 0, out.write, time.thread_time_ns, time.perf_counter_ns
    while True:
        r0 = clock()
        reference()
        ref = clock() - r0
        allocs += step()
        d = ctl.delay_ns()
        if d:
            # on the wall clock (vDSO): spinning on thread_time_ns, a system call each turn, added
            # 40 % more than the delay to the steps here (their caches and TLB flushed)
            spin(d)
        try:
            write(f"{time.monotonic_ns()} {allocs} {cpu()} {ref}\n")
        except BrokenPipeError:   # the harness is done
            return 0


if __name__ == "__main__":
    sys.exit(main())
