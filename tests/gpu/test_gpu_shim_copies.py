"""Copies of the shim on the real driver (tests/system/test_shim_copies.py's scenarios): PyTorch
under a tenant's copy of the shim, which the enforcer probes as a driver (--lib, as discovery
would), takes 4 x 256 MiB; each block is charged once and nothing stays reserved. Then the same
job under the copy the enforcer offers pods (run dir's lib/libconvgpu.so, marked as the shim's):
charged once, and 2 GiB more under its 2 GiB limit is the shim's out-of-memory error."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import lines_until, need

pytestmark = pytest.mark.gpu
MiB, GiB = 1 << 20, 1 << 30
RUN_DIR = "/run/convgpu-gpu-copies"
JOB = r"""
import json, sys, torch
blocks = [torch.empty(256 << 20, dtype=torch.uint8, device="cuda") for _ in range(4)]
torch.cuda.synchronize()
oom = None
if sys.argv[1:] == ["big"]:   # above the limit: the shim's out-of-memory error
    try:
        torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
        oom = False
    except torch.cuda.OutOfMemoryError:
        oom = True
print(json.dumps({"oom": oom}), flush=True)
sys.stdin.readline()
"""


def job_env(shim, lib):
    """The job's environment: the shim's (its socket) with LD_PRELOAD set to the copy under test.
    shim_env already names LD_PRELOAD, so a merge, not dict(**shim, LD_PRELOAD=...), which raises
    "got multiple values for keyword argument" (this test never ran before that was fixed)."""
    return {**os.environ, **shim, "LD_PRELOAD": lib}


def _row(name):
    from convgpu.enforcer.serving.server import request
    st = request(f"{RUN_DIR}/control.sock", {"cmd": "status"})["status"]
    return next(c for c in st["containers"] if c["name"] == name)["gpus"]["0"]


def test_pytorch_under_copies_of_the_shim_is_charged_once(root, tmp_path):
    from convgpu.cli.shim import shim_env
    from convgpu.enforcer.tenants.containers import cgroup_layout
    from convgpu.paths import shim_library
    lay = cgroup_layout()
    need(lay.v2_root is not None, "no cgroup2")
    base = Path(lay.v2_root) / f"convgpu-gpu-copies-{os.getpid()}"
    copy = tmp_path / "libmine.so"
    shutil.copy(shim_library(), copy)
    enf = subprocess.Popen([sys.executable, "-m", "convgpu.cli.main", "enforce", "--gpu-memory", "16GiB",
                            "--limit", "tenant=4GiB", "--limit", "pod=2GiB", "--lib", str(copy),
                            "--run-dir", RUN_DIR, "--state-dir", str(tmp_path / "state")],
                           stderr=subprocess.PIPE, text=True, cwd="/")
    log, procs = [], []
    try:
        lines_until(enf.stderr, lambda line: "enforcing:" in line, log, 120, "enforcer log")
        offered = os.path.join(RUN_DIR, "lib", "libconvgpu.so")
        for name, lib in (("tenant", str(copy)), ("pod", offered)):
            (base / name).mkdir(parents=True, exist_ok=True)
            env = job_env(shim_env(RUN_DIR), lib)
            p = subprocess.Popen(["/bin/sh", "-c", f'echo $$ > {base / name}/cgroup.procs && exec "$0" "$@"',
                                  sys.executable, "-c", JOB, *(["big"] if name == "pod" else [])], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env=env, cwd="/")
            procs.append(p)
            out = json.loads(p.stdout.readline())
            g = _row(name)
            print(name, out, g)
            # PyTorch's caching allocator rounds each 256 MiB block to itself: 1 GiB in blocks
            assert g["used"] == GiB and g["reserved"] == 0, (name, g)
            if name == "pod":   # 1 GiB + a context + 2 GiB > 2 GiB: the shim's own error
                assert out["oom"] is True
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        enf.terminate()
        enf.wait(timeout=60)
        log += enf.stderr.read().splitlines()
        if os.environ.get("CONVGPU_GPU_LOG"):
            with open(os.environ["CONVGPU_GPU_LOG"], "a") as f:
                f.write(json.dumps({"scenario": "shim copies", "log": log}) + "\n")
        for d in sorted(base.glob("*")) + [base]:
            try:
                d.rmdir()
            except OSError:
                pass
