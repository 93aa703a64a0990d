"""Issue 24 row 4 on the real driver: the default per-container quotas on the BPF maps (16,384
objects, 4,096 threads, 1,024 processes) leave real frameworks alone, and a container that
makes 1-byte allocations stops at exactly its quota while a PyTorch neighbour's 64 MiB rounds
stay exact. `convgpu enforce` as a subprocess, processes in cgroups of their own."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import lines_until, need, rest_of

pytestmark = pytest.mark.gpu
GiB, MiB = 1 << 30, 1 << 20
QUOTA = 16384
# PyTorch without its cache (every tensor is a cuMemAlloc) and CuPy without its pool: the most
# objects a framework makes; then a model-sized mix with the caching allocator. Sizes up to
# 1 MiB and 256 KiB: ~1.9 GiB in all with the contexts, well inside the 6 GiB limit (up to
# 4 MiB, as first written, asked ~7.7 GiB: the process was stalled over its limit, which read
# as a hang on the H100 runs of 2026-11-25d).
FRAMEWORKS = r"""
import os, sys, json, random
import torch, cupy
random.seed(1)
ts = [torch.empty(random.randint(1, 1 << 20), dtype=torch.uint8, device="cuda") for _ in range(3000)]
cupy.cuda.set_allocator(None)
cs = [cupy.empty(random.randint(1, 1 << 18), dtype=cupy.uint8) for _ in range(3000)]
m = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(48)]).cuda()
opt = torch.optim.Adam(m.parameters())
for _ in range(5):
    loss = m(torch.randn(256, 1024, device="cuda")).square().mean(); loss.backward(); opt.step(); opt.zero_grad()
torch.cuda.synchronize()
print(json.dumps({"pid": os.getpid(), "tensors": len(ts), "arrays": len(cs)}), flush=True)
sys.stdin.readline()
"""
ATTACK = r"""
import ctypes, os, sys
cu = ctypes.CDLL("libcuda.so.1"); cu.cuInit(0)
d = ctypes.c_int(); c = ctypes.c_void_p(); cu.cuDeviceGet(ctypes.byref(d), 0)
cu.cuDevicePrimaryCtxRetain(ctypes.byref(c), d); cu.cuCtxSetCurrent(c)
print(os.getpid(), flush=True)
p = ctypes.c_uint64()
for i in range(20000):
    assert cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(1)) == 0
print("all", flush=True)
sys.stdin.readline()
"""
VICTIM = r"""
import os, sys, torch
x = torch.empty(1, device="cuda")
for i in range(20):
    y = torch.empty(64 << 20, dtype=torch.uint8, device="cuda"); del y
    print("round", i + 1, flush=True)
print("done", flush=True)
sys.stdin.readline()
"""


class Env:
    """`convgpu enforce ARGS` and processes in cgroups of their own under base (also
    tests/gpu/test_gpu_failclosed.py)."""
    def __init__(self, base: Path, args=("--gpu-memory", "20GiB", "--default-limit", "6GiB", "--ctx-overhead", "700MiB")):
        self.base, self.procs, self.log = base, [], []
        self.enf = subprocess.Popen([sys.executable, "-m", "convgpu.cli.main", "enforce", *args],
                                    stderr=subprocess.PIPE, text=True, cwd="/")
        self.until("enforcing:")

    def until(self, text, timeout=90):
        lines_until(self.enf.stderr, lambda line: text in line, self.log, timeout, f"enforcer log ({text!r})")

    def start(self, name, code, env=None, wrap=()):
        cg = self.base / name
        cg.mkdir(parents=True, exist_ok=True)
        argv = ["/bin/sh", "-c", f'echo $$ > {cg}/cgroup.procs && exec "$0" "$@"', *wrap, sys.executable, "-c", code]
        p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, **(env or {})})
        self.procs.append(p)
        return p

    def status(self) -> dict:
        return json.loads(subprocess.run([sys.executable, "-m", "convgpu.cli.main", "status", "--json"],
                                         capture_output=True, text=True, cwd="/", timeout=60).stdout)

    def box(self, pid):
        return next(c for c in self.status()["containers"] if pid in c["pids"])

    def close(self, scenario):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        self.enf.terminate()
        self.enf.wait(timeout=30)
        self.log += rest_of(self.enf.stderr)   # what lines_until's reader has not handed out yet
        if os.environ.get("CONVGPU_GPU_LOG"):
            with open(os.environ["CONVGPU_GPU_LOG"], "a") as f:
                f.write(json.dumps({"scenario": scenario, "log": self.log[-40:]}) + "\n")
        for d in sorted(self.base.glob("*")) + [self.base]:
            try:
                d.rmdir()
            except OSError:
                pass


@pytest.fixture
def env(root):
    from convgpu.enforcer.tenants.containers import cgroup_layout
    lay = cgroup_layout()
    need(lay.v2_root is not None, "no cgroup2")
    return Path(lay.v2_root) / f"convgpu-gpu-quota-{os.getpid()}"


def test_gpu_frameworks_fit_the_default_quotas(env):
    e = Env(env)
    try:
        p = e.start("frameworks", FRAMEWORKS, {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"})
        got: list = []
        lines_until(p.stdout, lambda line: line.startswith("{"), got, 180, "frameworks")   # bounded
        out = json.loads(got[-1])
        q = e.box(out["pid"])["map_quota"]
        print("frameworks hold", q)                  # the numbers behind the default, for the report
        assert q["hits"] == 0 and q["denied"] == 0 and 6000 < q["objects"] < QUOTA
        p.stdin.write("\n")
        p.stdin.flush()
        assert p.wait(timeout=60) == 0
    finally:
        e.close("map quota: frameworks fit")


def test_gpu_attacker_stops_at_its_quota_victim_exact(env):
    e = Env(env)
    try:
        a = e.start("attacker", ATTACK)
        apid = int(a.stdout.readline())
        e.until(f"pid {apid} at its quota in the BPF maps (objects {QUOTA}/{QUOTA}")
        v = e.start("victim", VICTIM, {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"})
        seen: list = []
        lines_until(v.stdout, lambda line: line == "done", seen, 120, "victim")
        assert seen[-2:] == ["round 20", "done"]
        vb = e.box(v.pid)
        assert (vb["stalls"], vb["map_quota"]["hits"]) == (0, 0)
        assert vb["gpus"]["0"]["used"] < MiB         # x alone: no round left its 64 MiB charged
        ab = e.box(apid)
        assert ab["map_quota"]["objects"] == QUOTA and ab["map_quota"]["stopped_pids"] == [apid]
        assert a.poll() is None and open(f"/proc/{apid}/stat").read().rsplit(")", 1)[1].split()[0] in "Tt"   # t: held alone (ptrace)
    finally:
        e.close("map quota: attacker and victim")
