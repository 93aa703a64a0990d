"""Issue 47, finding 7 (a): a stray at the process quota was counted nowhere. A container at its
--max-processes (1 here: one placed process, 64 MiB) gets a second process, as `nobody`, that
takes 512 MiB through a driver copy of its own (no probe sees it: no call convgpu admits), with
the GPU's device node open (it shows it holds the memory: enforcer/attribution.py). NVML lists
it; the backstop places a process that proves it holds a row by what it holds, and at the quota
that placement returned nothing: the 512 MiB went against no container, nothing was said or
stopped. Now the row is its container's, placed or not: the container, 576 MiB under its 256 MiB
limit, is over by the driver's count, and both processes (the stray unplaced, still outside
`members`) are stopped within a second and stay stopped."""
import os
import shutil
import time

import pytest

from attack import CPUID, gpu_nodes, scratch  # noqa: F401  (fixtures)
from conftest import GiB, MiB, StateWatch, popen_in, read_until, start_in, stop_all, until, wait_state
from shim_attack import NOBODY, enforcer

pytestmark = pytest.mark.system


def nvml_env(build, env):
    """The enforcer sees the stand-in GPU through the stand-in NVML, per-process lists on, and
    the GPU's nodes as those of attack.gpu_nodes (a stray shows it holds the memory by them)."""
    return dict(env, LD_LIBRARY_PATH=f"{build}/standin-nvml:{env['LD_LIBRARY_PATH']}", CONVGPU_STANDIN_NVML_PROCS="1",
                CONVGPU_GPU_MAJORS=str(CPUID))


def row(enf, name):
    return next((c for c in enf.ctl(cmd="status")["status"]["containers"] if c["name"] == name), None)


def test_row47_a_stray_past_the_process_quota_counts_against_its_container(cgroups, build, env5, scratch, gpu_nodes):
    enf = enforcer(build, "--gpu-memory", "4GiB", "--limit", "many=256MiB", "--max-processes", "1",
                   env=nvml_env(build, env5))
    placed = stray = None
    try:
        cg = cgroups("many")
        placed = start_in(cg, build, env5, "alloc", "-n", 1, "-s", 64 * MiB, "--hold")
        assert f"allocated 1 {64 * MiB} pid={placed.pid}" in read_until(placed, "ready")
        until(lambda: row(enf, "many") is not None, 10, "placed")
        # the stray: the stand-in driver under a path of its own, which no probe watches
        own = scratch / "attacker" / "drv"
        own.mkdir()
        shutil.copy(build / "standin" / "libcuda.so.1", own / "libcuda.so.1")
        os.chmod(own, 0o755)
        t0 = time.monotonic()
        stray = popen_in(cg, *NOBODY, build / "cgcaller", "alloc", "-n", 1, "-s", 512 * MiB, "--hold",
                         env=dict(env5, LD_LIBRARY_PATH=str(own), CONVGPU_STANDIN_DEVNODES=str(gpu_nodes)))
        assert f"allocated 1 {512 * MiB} pid={stray.pid}" in read_until(stray, "ready")
        held = time.monotonic()
        # the container, both its processes, stopped by the driver's count
        for p in (placed, stray):
            wait_state(p.pid, "T", timeout=5)
        took, after = time.monotonic() - t0, time.monotonic() - held
        print(f"stopped {after:.2f} s after the stray said it holds its 512 MiB ({took:.2f} s after its start)")
        enf.wait_for(f"container many pid {stray.pid}: the container has 1 processes, its quota (--max-processes)")
        enf.wait_for("container many GPU0: over its limit by the driver's count: NVML 576.0 MiB")
        r = row(enf, "many")
        assert r["pids"] == [placed.pid], r                 # the stray is not placed: the quota holds
        g = r["gpus"]["0"]
        assert (g["nvml_used"], g["over_by"], g["over_limit"]) == (576 * MiB, 320 * MiB, True), g
        assert took < 3 and after < 1.0, (took, after)   # a sample every 0.25 s (backstop.SAMPLE_EVERY)
        # and they stay stopped while it is over: every thread of both, over a second
        watches = [StateWatch(p.pid).start() for p in (placed, stray)]
        time.sleep(1.0)
        for w in watches:
            seen = w.stop()
            assert len(seen) >= 200 and set(seen) <= {"T", "t"}, sorted(set(seen))
    finally:
        stop_all([placed, stray], enf)
