"""On the real driver, with a process on every GPU (the two-GPU host is where it failed):
`convgpu trace --json` ends within 3 s of SIGINT, and its probes are detached by a child
afterwards (probes/detach.py). Run on a GPU machine: pytest -m gpu tests/gpu/test_gpu_trace_exit.py"""
import json
import os
import subprocess
import sys

import pytest

from conftest import Caller, MiB, kill_if_running, sigint_took, trace_rows_until

pytestmark = pytest.mark.gpu


def test_sigint_ends_trace_at_once_on_every_gpu(root, build):
    from convgpu.probes.nvml import Nvml
    n = Nvml()
    if not n.ok:
        pytest.fail(f"-m gpu needs NVML: {n.error}")
    gpus = [g.index for g in n.gpus()]
    n.close()
    tr = subprocess.Popen([sys.executable, "-m", "convgpu.cli.main", "trace", "--json", "--no-events",
                           "--interval", "0.5"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    callers = []
    try:
        first = tr.stdout.readline()
        assert first, tr.stderr.read()[-2000:]
        assert json.loads(first)["mode"] == "driver"
        for dev in gpus:   # the real driver: cgcaller without the stand-in on its library path
            env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
            callers.append(Caller([str(build / "cgcaller"), "alloc", "-n", "1", "-s", str(64 * MiB), "-d", str(dev),
                                   "--hold"], env))
        want = {(c.p.pid, d) for c, d in zip(callers, gpus)}
        rows = trace_rows_until(tr, lambda rows: want <= {(pid, gpu) for pid, gpu, _ in rows}, 30)
        assert want <= {(pid, gpu) for pid, gpu, _ in rows}
        rc, took = sigint_took(tr, 120)
    finally:
        kill_if_running(tr)
        for c in callers:
            c.kill()
    print(f"\n{len(gpus)} GPU(s): trace ended {took:.2f} s after SIGINT")
    assert rc == 0 and took < 3.0, (rc, took, tr.stderr.read()[-2000:])
