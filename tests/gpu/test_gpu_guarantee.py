"""Issue 14 on the real driver: a driver copy nobody has probed is seen from its first call
(trace) and enforced from it (enforce); a restart after kill -9 with a large stalled call
rebuilds the books exactly, and jobs under their limits finish (PyTorch, CuPy, JAX)."""
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import lines_until, popen_in, rest_of

pytestmark = pytest.mark.gpu
GiB, MiB = 1 << 30, 1 << 20
LOG = os.environ.get("CONVGPU_GPU_LOG")

TORCH_EAGER = r"""
import json, os, sys, torch
x = torch.empty(int(sys.argv[1]) << 20, dtype=torch.uint8, device="cuda")
print(json.dumps({"pid": os.getpid(), "first": torch.cuda.memory_reserved()}), flush=True)
y = torch.empty(int(sys.argv[2]) << 20, dtype=torch.uint8, device="cuda") if int(sys.argv[2]) else None
print(json.dumps({"pid": os.getpid(), "second": torch.cuda.memory_reserved()}), flush=True)
sys.stdin.readline()
"""

CUPY_JOB = r"""
import sys, time, cupy
cupy.cuda.set_allocator(None)            # every array a driver allocation, no pool
a = cupy.ones(1 << 30, dtype=cupy.uint8)
print("first", flush=True)
time.sleep(3)
b = cupy.ones(1 << 30, dtype=cupy.uint8)
print("second", flush=True)       # no reduction here: its small outputs are allocations too
sys.stdin.readline()
"""

JAX_PREALLOC = r"""
import jax, jax.numpy as jnp       # default preallocation: one cuMemCreate of 75 % of the card
print("ran", float(jnp.ones(4).sum()), flush=True)
"""


def record(name, **data):
    if LOG:
        with open(LOG, "a") as f:
            f.write(json.dumps({"scenario": name, **data}) + "\n")


def start_in(cg, code, *args, env=None):
    return popen_in(cg, sys.executable, "-c", code, *args, env=env)


class GpuEnforcer:
    def __init__(self, *args, run_dir=None):
        self.run_dir = run_dir or tempfile.mkdtemp(prefix="convgpu-gpu14-", dir="/dev/shm")
        self.p = subprocess.Popen([sys.executable, "-m", "convgpu.cli.main", "enforce", "--run-dir", self.run_dir, *args],
                                  stderr=subprocess.PIPE, text=True, cwd="/")
        self.log = []
        self.closed = False
        self.wait_for("enforcing:", 90)

    def wait_for(self, text, timeout=60):
        return lines_until(self.p.stderr, lambda line: text in line, self.log, timeout, f"enforcer log ({text!r})")

    def status(self):
        from convgpu.enforcer.serving.server import request
        return request(f"{self.run_dir}/control.sock", {"cmd": "status"})["status"]

    def close(self, name):
        """Stop it and read the rest of its log (a test asserting on the log calls this first;
        its finally calls it again, which does nothing)."""
        if self.closed:
            return
        self.closed = True
        if self.p.poll() is None:
            self.p.terminate()
            self.p.wait(timeout=60)
        self.log += rest_of(self.p.stderr)
        record(name, log=self.log[-200:])


@pytest.fixture
def driver_copy():
    """The real driver copied to a new inode, found first through LD_LIBRARY_PATH."""
    src = next(p for p in ("/usr/local/nvidia/lib64/libcuda.so.1", "/lib/libcuda.so.1",
                           "/usr/lib/x86_64-linux-gnu/libcuda.so.1") if os.path.exists(p))
    d = Path(tempfile.mkdtemp(prefix="convgpu-drv-"))
    shutil.copy(os.path.realpath(src), d / "libcuda.so.1")
    env = dict(os.environ, LD_LIBRARY_PATH=f"{d}:{os.environ.get('LD_LIBRARY_PATH', '')}")
    yield d / "libcuda.so.1", env
    shutil.rmtree(d, ignore_errors=True)


def maps_has(pid, path):
    return str(path) in open(f"/proc/{pid}/maps").read()


def test_fresh_driver_copy_is_traced_from_the_first_call(root, driver_copy):
    path, env = driver_copy
    tr = subprocess.Popen([sys.executable, "-m", "convgpu.cli.main", "trace", "--json", "--interval", "0.5",
                           "--duration", "120", "--no-events"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, cwd="/")
    p = None
    try:
        json.loads(tr.stdout.readline())
        p = subprocess.Popen([sys.executable, "-c", TORCH_EAGER, "256", "0"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=env)
        first = json.loads(p.stdout.readline())["first"]
        json.loads(p.stdout.readline())
        assert maps_has(p.pid, path), "PyTorch did not load the copy"
        rows = []
        deadline = time.monotonic() + 20
        while not rows and time.monotonic() < deadline:
            snap = json.loads(tr.stdout.readline())
            rows = [x for c in snap["containers"] for x in c["processes"] if x["pid"] == p.pid]
        record("fresh copy traced", rows=rows, reserved=first, libraries=snap["libraries"])
        assert [(r["live"], r["contexts"]) for r in rows] == [(first, 1)], rows
        assert any(str(path) in x for x in snap["libraries"])
    finally:
        if p:
            p.kill()
            p.wait()
        tr.terminate()
        tr.wait(timeout=30)


def test_fresh_driver_copy_is_enforced_from_the_first_call(root, driver_copy, cgroups):
    """Limit 2 GiB: PyTorch's 1 GiB (beside its ~0.5 GiB context) runs, its next 1 GiB would
    exceed the limit and is stopped before it runs: NVML never shows it."""
    path, env = driver_copy
    enf = GpuEnforcer("--gpu-memory", "8GiB", "--default-limit", "2GiB", "--ctx-overhead", "600MiB")
    p = None
    try:
        p = start_in(cgroups("fresh"), TORCH_EAGER, 1024, 1024, env=env)
        first = json.loads(p.stdout.readline())["first"]
        enf.wait_for("above its limit")
        from conftest import wait_state
        wait_state(p.pid, "T")
        assert maps_has(p.pid, path)
        from convgpu.probes.nvml import Nvml
        nv = Nvml()
        used = sum(v for (pid, _), v in nv.process_memory().items() if pid == p.pid)
        nv.close()
        st = enf.status()
        row = next(c for c in st["containers"] if c["name"] == "fresh")
        record("fresh copy enforced", nvml=used, status=row, discovery=st["discovery"])
        assert first == GiB and row["gpus"]["0"]["used"] == GiB and row["over_limit_events"] == 1
        assert used < GiB + 1024 * MiB                        # the second GiB never reached the card
        assert st["unchecked_calls"] == 0 and st["unprobed"] == []
    finally:
        if p:
            p.kill()
            p.wait()
        enf.close("fresh copy enforced log")


def test_restart_after_kill_9_with_a_large_stalled_call(root, cgroups):
    """The H100 sequence: JAX's 60 GB preallocation stalls over a 4 GiB limit; kill -9; the
    watchdog resumes it, it runs and exits; a new enforcer at once; two CuPy jobs (1 GiB, 3 s,
    1 GiB more) under 3 GiB limits on 5 GiB: both finish, and the books hold no reservation."""
    enf = GpuEnforcer("--gpu-memory", "5GiB", "--default-limit", "4GiB")
    enf2 = None
    procs = []
    seen = []

    def line(p, what, timeout=60):   # bounded: a stalled job fails the test, it does not hang it
        got = lines_until(p.stdout, lambda x: True, seen, timeout, what).strip()
        print(what, got, time.strftime("%T"), flush=True)
        return got
    try:
        jx = start_in(cgroups("jax"), JAX_PREALLOC)
        procs.append(jx)
        enf.wait_for("above its limit", 120)
        enf.p.send_signal(signal.SIGKILL)
        enf.p.wait()
        enf.wait_for("probes kept for a successor")
        assert line(jx, "jax", 120).startswith("ran")
        assert jx.wait(timeout=60) == 0
        enf2 = GpuEnforcer("--gpu-memory", "5GiB", "--default-limit", "3GiB", run_dir=enf.run_dir)
        jobs = [start_in(cgroups(n), CUPY_JOB) for n in ("one", "two")]
        procs += jobs
        for j in jobs:
            assert line(j, "job first") == "first"
        # the container placed first was assigned its whole 3 GiB, the other what was left
        # (2 GiB): the first one's second GiB comes at once, the other's after it exits
        ahead = None
        deadline = time.monotonic() + 60
        while ahead is None and time.monotonic() < deadline:
            for j in jobs:
                with contextlib.suppress(AssertionError):
                    assert line(j, "a job's second", 0.2) == "second"
                    ahead = j
                    break
        assert ahead is not None, f"neither job's second GiB came in 60 s: {seen}"
        later = jobs[1 - jobs.index(ahead)]
        names = {jobs[0]: "one", jobs[1]: "two"}
        st = enf2.status()
        first = next(c for c in st["containers"] if c["name"] == names[ahead])["gpus"]["0"]
        record("restart books", first=first, status=st)
        assert (first["used"], first["reserved"]) == (2 * GiB, 0)
        ahead.stdin.write("\n")
        ahead.stdin.flush()
        assert ahead.wait(timeout=60) == 0
        assert line(later, "the other job's second") == "second"
        other = next(c for c in enf2.status()["containers"] if c["name"] == names[later])["gpus"]["0"]
        assert (other["used"], other["reserved"]) == (2 * GiB, 0)
        later.stdin.write("\n")
        later.stdin.flush()
        assert later.wait(timeout=60) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for p in procs:
            seen.append(p.stderr.read()[-3000:])
        record("restart lines", lines=seen)
        if enf2:
            enf2.close("restart: second enforcer")
        enf.close("restart: first enforcer")
