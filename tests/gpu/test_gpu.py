"""The system scenarios on the real driver (run on the GPU machine: pytest -m gpu).

For every workload: the bytes convgpu tracks equal what the program (or PyTorch) says it
asked for, and tracked bytes + context overhead agree with NVML's per-process figure within
2 MiB or 1 %. The overhead here is the *estimate* a process gets before NVML has measured
it: the device's measurement on an earlier process (baseline), so the comparison is not
circular. Results are appended to $CONVGPU_GPU_LOG (JSON lines) for docs/."""
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import EVENTS, MiB, Caller, drain as poll, footprint

pytestmark = pytest.mark.gpu
HERE = Path(__file__).parent
LOG = os.environ.get("CONVGPU_GPU_LOG")


@pytest.fixture(scope="module")
def nvml():
    from convgpu.probes.nvml import Nvml
    n = Nvml()
    if not n.ok:
        pytest.fail(f"-m gpu needs NVML: {n.error}")
    yield n
    n.close()


@pytest.fixture(scope="module")
def gpu_tracer(root):
    from convgpu.probes.tracer import Tracer
    t = Tracer(discover=True).start()
    assert any(lib.kind == "cuda" for lib in t.libraries), "no libcuda.so.1 found"
    yield t
    t.close()


def record(name, **data):
    if LOG:
        with open(LOG, "a") as f:
            f.write(json.dumps({"scenario": name, **data}) + "\n")


def measure(tracer, nvml, pid, settle=1.0):
    """(ProcUsage on GPU 0, NVML bytes for pid) once NVML shows the process."""
    deadline = time.monotonic() + 10
    nv = None
    while time.monotonic() < deadline:
        time.sleep(settle)
        nv = nvml.process_memory().get((pid, 0))
        if nv:
            break
    poll(tracer)
    u = {x.dev: x for x in tracer.usage() if x.pid == pid}
    return u.get(0), nv


baseline: dict[str, int] = {}


def check(name, tracer, nvml, pid, expected_live, kind):
    u, nv = measure(tracer, nvml, pid)
    assert u is not None, f"{name}: no accounting for pid {pid}"
    overhead = nv - u.live
    est = baseline.setdefault(kind, overhead)     # first process of a kind: the measurement
    err = abs(u.live + est - nv)
    record(name, pid=pid, tracked=u.live, expected=expected_live, contexts=u.contexts, nvml=nv,
           overhead=overhead, estimate=est, error=err, allocs=u.n_alloc)
    assert u.live == expected_live, f"{name}: tracked {u.live} != expected {expected_live}"
    assert 100 * MiB < overhead < 2048 * MiB, f"{name}: implausible context overhead {overhead}"
    assert err <= max(2 * MiB, nv // 100), f"{name}: tracked+overhead {u.live + est} vs NVML {nv}"
    return u


def test_driver_api_program(gpu_tracer, nvml, build):
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}   # the real driver
    base = Caller([str(build / "cgcaller"), "alloc", "-n", "1", "-s", str(2 * MiB), "--hold"], env)
    check("driver-api baseline (1 x 2 MiB)", gpu_tracer, nvml, base.pid, 2 * MiB, "driver")
    c = Caller([str(build / "cgcaller"), "alloc", "-n", "23", "-s", str(3 * MiB), "--hold"], env)
    u = check("driver-api 23 x 3 MiB", gpu_tracer, nvml, c.pid, 23 * footprint(3 * MiB), "driver")
    assert (u.n_alloc, u.contexts) == (23, 1)
    assert c.release() == 0 and base.release() == 0


@pytest.mark.parametrize("family,n,size", [("vmm", 4, 2 * MiB), ("async", 3, 4 * MiB), ("managed", 2, 4 * MiB),
                                           ("pitch", 3, 4096), ("array", 2, 0), ("runtime", 3, 2 * MiB)])
def test_driver_families(gpu_tracer, nvml, build, family, n, size):
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    if family == "runtime":
        env["LD_LIBRARY_PATH"] = "/usr/local/cuda/lib64"
    c = Caller([str(build / "cgcaller"), family, "-n", str(n), "-s", str(size), "--hold"], env)
    count, total = c.allocated
    gpu_tracer.poll()
    u = {x.dev: x for x in gpu_tracer.usage() if x.pid == c.pid}[0]
    nv = nvml.process_memory().get((c.pid, 0))
    record(f"family {family}", pid=c.pid, tracked=u.live, expected=total, allocs=u.n_alloc, nvml=nv)
    if family in ("alloc", "async", "vmm", "managed"):   # one size each: the footprint is known
        total = count * footprint(total // count)
    if family != "array":   # arrays: estimated from descriptors, recorded for comparison only
        assert (u.live, u.n_alloc) == (total, count)
    assert c.release() == 0
    gpu_tracer.poll()
    assert [x for x in gpu_tracer.usage() if x.pid == c.pid] == []


def test_two_contexts_one_gpu(gpu_tracer, nvml, build):
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    c = Caller([str(build / "cgcaller"), "ctx", "-s", str(8 * MiB), "--hold"], env)
    u, nv = measure(gpu_tracer, nvml, c.pid)
    record("two contexts on GPU 0", pid=c.pid, tracked=u.live, contexts=u.contexts, nvml=nv, overhead=nv - u.live)
    assert (u.contexts, u.live) == (2, 8 * MiB)
    assert c.release() == 0


def test_static_cudart_program(gpu_tracer, nvml, tmp_path):
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if not os.path.exists(nvcc):
        pytest.fail("-m gpu needs nvcc for the static-cudart program")
    exe = tmp_path / "static_alloc"
    subprocess.run([nvcc, "-o", str(exe), str(HERE / "static_alloc.cu")], check=True)
    assert b"libcudart.so" not in subprocess.run(["ldd", str(exe)], capture_output=True).stdout
    c = Caller([str(exe)], dict(os.environ))
    check("nvcc static cudart 123 MiB", gpu_tracer, nvml, c.pid, footprint(123 * MiB), "driver")
    assert c.release() == 0


@pytest.mark.parametrize("conf,api", [("", "cuMemAlloc_v2"), ("expandable_segments:True", "cuMemCreate"),
                                      ("backend:cudaMallocAsync", "cuMemAllocAsync")])
def test_pytorch_allocators(gpu_tracer, nvml, conf, api):
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=conf)
    p = subprocess.Popen([sys.executable, str(HERE / "torch_workload.py")], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env=env)
    try:
        info = json.loads(p.stdout.readline())
        assert p.stdout.readline().strip() == "ready"
        u, nv = measure(gpu_tracer, nvml, p.pid)
        overhead = nv - u.live
        est = baseline.setdefault("torch", overhead)   # the first PyTorch process measures it
        err = abs(u.live + est - nv)
        record(f"pytorch {conf or 'default'}", pid=p.pid, tracked=u.live, torch_reserved=info["reserved"],
               torch_allocated=info["allocated"], contexts=u.contexts, nvml=nv, overhead=overhead,
               estimate=est, error=err, allocs=u.n_alloc)
        # The driver sees PyTorch's segments (memory_reserved) plus what libraries allocate
        # outside its allocator: cuBLAS's workspace, 64 MiB on the H100 run of 2026-11-22.
        extra = u.live - info["reserved"]
        assert 0 <= extra <= 128 * MiB, f"tracked {u.live} vs torch reserved {info['reserved']}"
        if conf != "backend:cudaMallocAsync":
            assert err <= max(2 * MiB, nv // 100)
        # cudaMallocAsync: the stream-ordered pool keeps physical memory beyond what was asked
        # of it, invisible to any exported call; NVML shows it, so it lands in the measured
        # context column (docs/DESIGN.md). Recorded above, not comparable to the estimate.
        p.stdin.write("\n")
        p.stdin.flush()
        after = json.loads(p.stdout.readline())
        assert p.stdout.readline().strip() == "exit"
        p.wait(timeout=60)
        time.sleep(0.2)
        poll(gpu_tracer)
        evs = EVENTS.get(p.pid, [])
        assert api in {e.api for e in evs if e.op == "alloc"}
        ex = [e for e in evs if e.op == "exit"]
        assert len(ex) == 1
        record(f"pytorch {conf or 'default'} exit", held_at_exit=ex[0].size, reserved_after_empty_cache=after["after_empty_cache"])
        assert [x for x in gpu_tracer.usage() if x.pid == p.pid] == []
    finally:
        if p.poll() is None:
            p.kill()


def test_probes_on_real_driver(gpu_tracer):
    """Every probe attached to the real libcuda fired in the self-test (none silently dead),
    and the entry points start with an instruction the kernel emulates (push)."""
    driver = [lp for lp in gpu_tracer.attached if lp.library.kind == "cuda"]
    assert driver
    for lp in driver:
        rows = [(a.probe.symbol, a.ok, a.insn, a.fired, a.reason) for a in lp.probes]
        record("probes", library=str(lp.library), probes=rows)
        assert not lp.missing_required
        assert [r for r in rows if r[1] and r[3] is not True] == []
        assert {r[2] for r in rows if r[1]} == {"emulated"}


@pytest.mark.parametrize("size", [256 << 10, 1 * MiB, 3 * MiB // 2, 2 * MiB, 3 * MiB, 5 * MiB])
def test_device_page_rounding(gpu_tracer, nvml, build, size):
    """The footprint rule (above 1 MiB: whole 2 MiB pages) against NVML, size by size."""
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    c = Caller([str(build / "cgcaller"), "alloc", "-n", "8", "-s", str(size), "--hold"], env)
    check(f"footprint 8 x {size}", gpu_tracer, nvml, c.pid, 8 * footprint(size), "driver")
    assert c.release() == 0
