"""The kill -9 torture (issue 31, part 3) on the real driver: three containers (two by `convgpu
run --limit --name`, one given its limit by `convgpu limit set`) of two processes each, every
process tests/standin/turns.c built against the real libcuda (the driver API: a ~518 MiB
context, then three threads that each allocate 256 MiB with cuMemAlloc_v2, hold it 200 ms and
free it, 20 rounds), limits of 2304 MiB (two contexts and four allocations: two threads of six
wait) on a 5 GiB --gpu-memory (the limits together are 6.75 GiB). The enforcer is killed with
SIGKILL 24 times and restarted at once, at random moments and at fault points (bench/torture.py
says what is checked after each restart). NVML's per-process counts are the driver's: a
container may pass its limit by no more than 4 MiB (page rounding) once the restarted enforcer
has settled, and `status` must equal them within 192 MiB a container (a context is charged at
its estimate until NVML measures it, which a process allocating without pauses never lets it do).
The enforcer runs with --handover, as the unit file and the DaemonSet run it. Without it, a
kill -9 fails open until the successor admits (the watchdog resumes every held call, admission
off): on the H100 at 2bdeffc the calls of that window put containers past their limits, and the
successor's backstop, which NVML's counts turn on there (not on the stand-in), stopped them over
their limits where they could not free what put them there: 4 over-limit samples and 60
stopped threads no status listed as waiting (issue 47). With --handover the held calls stay held
and admission stays on through a kill -9 until the successor takes them over.
Run: CONVGPU_REQUIRE_SYSTEM=1 python3 -m pytest -m gpu tests/gpu/test_gpu_torture.py -q -rA -s"""
import os
import sys
from pathlib import Path

import pytest

from test_gpu_guarantee import record

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # bench/ lives at the repo root
from bench.torture import Setup, Torture  # noqa: E402

pytestmark = pytest.mark.gpu
MiB, GiB = 1 << 20, 1 << 30
DRIVERS = ("/usr/local/nvidia/lib64/libcuda.so.1", "/lib/x86_64-linux-gnu/libcuda.so.1",
           "/usr/lib/x86_64-linux-gnu/libcuda.so.1", "/lib/libcuda.so.1")


def test_kill_9_torture_with_real_cuda_processes(root):
    from convgpu.paths import build_dir
    from convgpu.probes.nvml import Nvml
    lib = next((os.path.realpath(p) for p in DRIVERS if os.path.exists(p)), None)
    assert lib, "no libcuda.so.1"
    turns = str(build_dir() / "turns")
    assert os.path.exists(turns), "make built no build/turns"
    nv = Nvml()
    assert nv.ok, nv.error
    env = {k: v for k, v in os.environ.items() if k not in ("CONVGPU_FAULT", "CUDA_VISIBLE_DEVICES")}
    env["CUDA_VISIBLE_DEVICES"] = "0"
    s = Setup(lib=lib, turns=turns, env=env, counts=nv.process_memory, containers=3, procs=2, threads=3,
              size=256 * MiB, hold_ms=200, rounds=20, limit=2304 * MiB, default_limit=1536 * MiB,
              gpu_memory=5 * GiB, ctx=None, tolerance=192 * MiB, over_tolerance=4 * MiB,
              kills=int(os.environ.get("CONVGPU_TORTURE_KILLS", "24")), seed=31, deadline_s=480,
              extra=("--handover", "30"),
              log=lambda line: print(line, flush=True))
    try:
        r = Torture(s).run()
    finally:
        nv.close()
    summary = r.summary()
    print("torture:", summary)
    record("kill -9 torture", **summary, failures=r.failures())
    assert r.failures() == [], summary
    assert summary["kills"] >= s.kills and r.jobs_done >= 3, summary
