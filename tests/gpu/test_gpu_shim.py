"""The preload shim on the real driver, under the running enforcer: PyTorch under a 1 GiB limit
gets torch.cuda.OutOfMemoryError for 2 GiB, sees the limit less its context in mem_get_info
(issue 18: enforcer/serving/memview.py), and still trains a small model; an nvcc program (static
cudart) is limited through its driver calls; nvidia-smi and pynvml show the limit less a
context as the GPU's memory. Both with the probes on and with the shim alone (`--no-probes`: the shim's reports are the accounting)."""
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import lines_until

pytestmark = pytest.mark.gpu
GiB = 1 << 30
HERE = Path(__file__).parent
RUN_DIR = "/run/convgpu-gpu-shim"


def ceiling() -> int:
    """What the enforcer's memory answers leave for a context NVML has not measured yet (a
    process's first query comes before any measurement)."""
    from convgpu.enforcer.serving.server import request
    return request(f"{RUN_DIR}/control.sock", {"cmd": "status"})["status"]["shim_ctx_ceiling"]["0"]["bytes"]


TRAIN = r"""
import json, torch
free, total = torch.cuda.mem_get_info()
try:
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    oom = False
except torch.cuda.OutOfMemoryError:
    oom = True
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.5)
X, y = torch.randn(512, 256, device="cuda"), torch.randint(0, 10, (512,), device="cuda")
losses = []
for _ in range(100):
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(X), y)
    loss.backward()
    opt.step()
    losses.append(loss.item())
print(json.dumps({"free": free, "total": total, "oom": oom, "first": losses[0], "last": losses[-1]}))
"""


@pytest.fixture(params=["probes", "shim-only"])
def enforcer(root, request, tmp_path):
    from convgpu.enforcer.tenants.containers import cgroup_layout
    base = Path(cgroup_layout().v2_root) / f"convgpu-gpu-shim-{os.getpid()}"
    run_dir = RUN_DIR
    enf = subprocess.Popen([sys.executable, "-m", "convgpu.cli.main", "enforce", "--gpu-memory", "16GiB",
                            "--limit", "torch=1GiB", "--limit", "nvcc64=64MiB", "--limit", "nvcc1g=1GiB",
                            "--run-dir", run_dir, "--state-dir", str(tmp_path / "state"),
                            *(["--no-probes"] if request.param == "shim-only" else [])],
                           stderr=subprocess.PIPE, text=True, cwd="/")
    log = []
    lines_until(enf.stderr, lambda line: "enforcing:" in line, log, 120, "enforcer log")
    # The ceiling a test reads must be the one its job is told: the context measured at start,
    # not the conservative figure in force until that measurement lands (a test read 1,152 MiB
    # while its job was told 622 MiB on the H200, 2026-11-28).
    from convgpu.enforcer.serving.server import request
    deadline = time.monotonic() + 120
    while request(f"{run_dir}/control.sock", {"cmd": "status"})["status"]["gpus"]["0"]["ctx_estimate"]["source"] \
            != "measured-at-start":
        assert time.monotonic() < deadline, "the enforcer never measured a context at start"
        time.sleep(0.2)
    from convgpu.cli.shim import shim_env
    env = dict(os.environ, **shim_env(run_dir), CONVGPU_SHIM_LOG="2")

    def run(name, argv):
        (base / name).mkdir(parents=True, exist_ok=True)
        return subprocess.run(["/bin/sh", "-c", f'echo $$ > {base / name}/cgroup.procs && exec "$0" "$@"', *argv],
                              env=env, capture_output=True, text=True, timeout=300, cwd="/")
    yield run
    enf.terminate()
    enf.wait(timeout=60)
    for d in sorted(base.glob("*")) + [base]:
        try:
            d.rmdir()
        except OSError:
            pass


def test_pytorch_under_a_1gib_limit(enforcer):
    # Before the job: its exit may teach the enforcer a larger context. Each enforcer of this
    # file keeps what it learns in a state dir of its own test: with the host's, the ceiling was
    # the p90 of every context measured by earlier tests of the session (an H100 run read 690 MiB
    # here and the job was told 704 MiB less, one test order but not another).
    ceil = ceiling()
    r = enforcer("torch", [sys.executable, "-c", TRAIN])
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    print(out, "ceiling before", ceil, "after", ceiling())
    assert out["oom"] is True and out["total"] == GiB - ceil and 0 <= out["free"] <= out["total"]
    assert out["last"] < out["first"] * 0.8          # it trained


def test_nvcc_static_program_limited_through_driver_calls(enforcer, tmp_path):
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    exe = tmp_path / "static_alloc"
    subprocess.run([nvcc, "-o", str(exe), str(HERE / "static_alloc.cu")], check=True)
    denied = enforcer("nvcc64", [str(exe)])            # 123 MiB asked, 64 MiB allowed
    assert denied.returncode == 2 and "denied" in denied.stderr, denied.stderr
    allowed = enforcer("nvcc1g", ["/bin/sh", "-c", f"echo | {exe}"])
    assert allowed.returncode == 0 and "allocated 1 128974848" in allowed.stdout, allowed.stderr


def test_nvidia_smi_and_pynvml_show_the_limit(enforcer):
    """NVML's memory queries inside a limited container: the limit less the context a process
    needs (issue 18; none made here yet: counted at the ceiling), not the card's 80 GiB."""
    smi = shutil.which("nvidia-smi")
    assert smi, "nvidia-smi is on every GPU host this runs on"
    r = enforcer("torch", [smi, "--query-gpu=memory.total,memory.used", "--format=csv,noheader,nounits", "-i", "0"])
    assert r.returncode == 0, r.stderr
    print(r.stdout.strip())
    # MiB: the 1 GiB limit less the context a process needs (whole MiB: ceilings are in 2 MiB pages)
    assert [int(x) for x in r.stdout.split(",")] == [(GiB - ceiling()) // (1 << 20), 0]
    r = enforcer("torch", [sys.executable, "-c", "import pynvml; pynvml.nvmlInit(); "
                           "h = pynvml.nvmlDeviceGetHandleByIndex(0); m = pynvml.nvmlDeviceGetMemoryInfo(h); "
                           "v = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2); "
                           "print(m.total, m.used, v.total, v.used)"])
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(GiB - ceiling()), "0", str(GiB - ceiling()), "0"]
