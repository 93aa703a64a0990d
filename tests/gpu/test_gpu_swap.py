"""Issue 46 on the real driver: a PyTorch job A holding 60 % of the GPU's capacity idles, another
(B) asks for 60 % and runs (A is swapped out by the driver's checkpoint, --swap-idle), and A's next
training step after B exits gives the same loss as a run of A with nothing in between. The
capacity is a virtual 20 GiB (--gpu-memory), so that the copies fit the device time of a run: 60 %
of it is 12 GiB. NVML's figures and the times go to the run's log (record)."""
import os
import subprocess
import sys
import time

import pytest

from test_gpu_failclosed import base, read  # noqa: F401  (base: a fixture)
from test_gpu_guarantee import record
from test_gpu_map_quota import Env

pytestmark = pytest.mark.gpu
GiB = 1 << 30
CAP = 20 * GiB
SHARE = 12 * GiB
LIMIT = 13 * GiB   # a share, its context and cuBLAS's workspace
TRAIN = r"""
import os, sys, torch
torch.manual_seed(0)
torch.use_deterministic_algorithms(True)
ballast = torch.full((int(sys.argv[1]),), 7, dtype=torch.uint8, device="cuda")   # the rest of its 60 %
model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 10)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(512, 1024, device="cuda"), torch.randint(0, 10, (512,), device="cuda")
def step():
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    torch.cuda.synchronize()
    return f"{loss.item():.9g}"
for i in range(3):
    print("loss", i, step(), flush=True)
print("idle", os.getpid(), flush=True)
sys.stdin.readline()
# checked 16 MiB at a time: `ballast == 7` would be another 11 GiB, and a sum in int64 88 GiB
# (its cast is made whole first), both over A's limit (held there)
whole = all(int(c.sum(dtype=torch.int64)) == 7 * c.numel() for c in ballast.split(1 << 24))
print("loss 3", step(), "ballast", whole, flush=True)
sys.stdin.readline()
"""
ASK = r"""
import sys, torch
t = torch.empty(int(sys.argv[1]), dtype=torch.uint8, device="cuda")
t.fill_(1)
torch.cuda.synchronize()
print("ran", flush=True)
"""
ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def nvml_of(pid: int) -> int:
    import pynvml
    pynvml.nvmlInit()
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        return sum(p.usedGpuMemory or 0 for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h) if p.pid == pid)
    finally:
        pynvml.nvmlShutdown()


def losses(lines: list[str]) -> dict[int, str]:
    return {int(x.split()[1]): x.split()[2] for x in lines if x.startswith("loss")}


def test_gpu_46_an_idle_pytorch_job_goes_out_for_another_and_trains_on_as_if_nothing_happened(base):
    ballast = SHARE - 1 * GiB   # its context, model, cuBLAS and allocator take the rest of its 60 %
    # the reference: A alone, nothing in between
    train, ask = TRAIN.replace("sys.argv[1]", str(ballast)), ASK.replace("sys.argv[1]", str(SHARE))
    ref = subprocess.run([sys.executable, "-c", train], input="\n\n", capture_output=True, text=True,
                         timeout=300, env={**os.environ, **ENV})
    want = losses(ref.stdout.splitlines())
    assert len(want) == 4, ref.stderr[-2000:]
    # limits below the capacity: with both at the whole card no grant to B is ever safe while A
    # holds anything (neither could finish alone), swap or not (policies.safe_assignment)
    e = Env(base, ("--gpu-memory", f"{CAP}B", "--limit", f"a={LIMIT}B", "--limit", f"b={LIMIT}B", "--swap-idle", "2"))
    seen = {"reference": want}
    try:
        a = e.start("a", train, env=ENV)
        out = read(a, [], "idle", 180)
        pid = int(out[-1].split()[1])
        seen["a_nvml_before"] = nvml_of(pid)
        t0 = time.monotonic()
        b = e.start("b", ask, env=ENV)
        got = read(b, [], "ran", 120)
        seen["b_wait_s"] = round(time.monotonic() - t0, 2)
        if not got or got[-1] != "ran":
            seen["status_while_b_waits"] = e.status()
        assert got and got[-1] == "ran", (got, seen)
        seen["a_nvml_out"] = nvml_of(pid)
        assert b.wait(timeout=60) == 0
        t1 = time.monotonic()
        a.stdin.write("go\n")
        a.stdin.flush()
        after = read(a, out, "loss 3", 240)
        seen["a_back_s"] = round(time.monotonic() - t1, 2)
        seen["a_nvml_back"] = nvml_of(pid)
        seen["losses"] = losses(after)
        e.until(f"swap out a pid {pid}")
        e.until(f"swap in a pid {pid}: back on the GPU")
        assert losses(after) == want, seen                         # the same training, bit for bit
        assert after[-1].endswith("ballast True"), after[-1]
        assert seen["a_nvml_out"] == 0 and seen["a_nvml_back"] >= SHARE - GiB, seen
    finally:
        e.close("46 swap")
        record("46 swap PyTorch", **seen, log=[x for x in e.log if " INFO " in x or " WARNING " in x or " ERROR " in x][-60:])
