"""Enforcement on the real driver: two PyTorch processes in two cgroups under a --gpu-memory
smaller than their sum; one stalls, resumes when the other exits, both finish correctly."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import lines_until, need

pytestmark = pytest.mark.gpu
GiB = 1 << 30
WORK = r"""
import json, os, sys, torch
x = torch.ones(int(sys.argv[1]) << 20, dtype=torch.uint8, device="cuda")   # the big allocation
# no x.sum(): on uint8 it first makes an int64 copy, 8x the tensor (seen: a 16 GiB request)
s = int(x[::1 << 20].sum().item()) << 20
print(json.dumps({"pid": os.getpid(), "sum": s}), flush=True)
sys.stdin.readline()
"""


def test_two_pytorch_processes_one_waits(root):
    from convgpu.enforcer.containers import cgroup_layout
    lay = cgroup_layout()
    need(lay.v2_root is not None, "no cgroup2")
    base = Path(lay.v2_root) / f"convgpu-gpu-{os.getpid()}"
    for n in ("first", "second"):
        (base / n).mkdir(parents=True, exist_ok=True)
    # context ~0.6 GiB per PyTorch process (measured) + 2 GiB each; capacity fits one and a half
    enf = subprocess.Popen([sys.executable, "-m", "convgpu.cli.main", "enforce", "--gpu-memory", "4GiB",
                            "--default-limit", "3GiB", "--ctx-overhead", "700MiB", "--policy", "fifo"],
                           stderr=subprocess.PIPE, text=True, cwd="/")   # no source tree on sys.path
    log = []

    def until(text, timeout=60):
        lines_until(enf.stderr, lambda line: text in line, log, timeout, f"enforcer log ({text!r})")

    procs = []
    try:
        until("enforcing:")
        for n in ("first", "second"):
            argv = ["/bin/sh", "-c", f'echo $$ > {base / n}/cgroup.procs && exec "$0" "$@"', sys.executable, "-c", WORK, "2048"]
            procs.append(subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
            if n == "first":
                assert json.loads(procs[0].stdout.readline())["sum"] == 2048 << 20
        until("stall second")
        time.sleep(1)
        assert procs[1].poll() is None
        procs[0].stdin.write("\n")
        procs[0].stdin.flush()
        assert procs[0].wait(timeout=60) == 0
        until("resume second")
        assert json.loads(procs[1].stdout.readline())["sum"] == 2048 << 20
        procs[1].stdin.write("\n")
        procs[1].stdin.flush()
        assert procs[1].wait(timeout=60) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        enf.terminate()
        enf.wait(timeout=30)
        log += enf.stderr.read().splitlines()
        if os.environ.get("CONVGPU_GPU_LOG"):
            with open(os.environ["CONVGPU_GPU_LOG"], "a") as f:
                f.write(json.dumps({"scenario": "enforce two pytorch", "log": log}) + "\n")
        for n in ("first", "second"):
            try:
                (base / n).rmdir()
            except OSError:
                pass
        try:
            base.rmdir()
        except OSError:
            pass
