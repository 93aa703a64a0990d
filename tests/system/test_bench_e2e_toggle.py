"""bench.e2e_toggle on the stand-in driver (issue 15's check of the method): one workload
process calls the stand-in's cuMemAlloc_v2/cuMemFree_v2 and computes, step after step, while
the harness switches the host under it between bare, `convgpu trace`'s real uprobes (attached
to the running process, detached while it runs on) and a known injected delay. The delay's
interval must contain the truth; the tracer must count exactly the calls the workload made
while it was attached; every block has bare neighbours. Shapes and truth, never machine speed."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))   # bench/ lives at the repo root
from bench.plots import plot_toggle  # noqa: E402

pytestmark = pytest.mark.system
DELAY_US, ALLOCS = 40.0, 10


def test_toggled_modes_recover_an_injected_delay_and_count_the_running_process(root, build, tmp_path):
    out = tmp_path / "e2e.json"
    env = {**os.environ, "CONVGPU_STANDIN_SHM": f"/convgpu-e2e-{os.getpid()}"}
    # bare probed bare delay bare delay ... bare: 7 blocks besides bare, the probed one first
    r = subprocess.run([sys.executable, "-m", "bench.e2e_toggle", "standin", "--minutes", "8", "--blocks", "7",
                        "--block", "1", "--settle", "0.2", "--clock", "cpu", "--modes", "probed," + ",".join(["delay"] * 6),
                        "--delay-us", str(DELAY_US),
                        "--json", str(out), "--", "--lib", str(build / "standin" / "libcuda.so.1"),
                        "--allocs", str(ALLOCS), "--warmup", "0.5"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(out.read_text())
    blocks, modes = data["blocks"], data["modes"]
    # bare first and last, every other block between two bare ones
    assert [b["mode"] == "bare" for b in blocks] == [i % 2 == 0 for i in range(len(blocks))]
    assert blocks[1]["mode"] == "probed" and modes["probed"]["blocks"] == 1
    assert len(blocks) == 15 and modes["delay"]["blocks"] == modes["delay"]["paired"] == 6
    for b in blocks:
        assert b["steps"] == len(b["durations_ns"]) >= 3
        assert b["median_ns"] > 0 and b["stop_ns"] > b["start_ns"]
    # the stand-in's own count: ALLOCS per step, every step of the block counted
    for b in blocks:
        assert b["own_alloc_rate"] * (b["stop_ns"] - b["start_ns"]) / 1e9 == pytest.approx(ALLOCS * b["steps"])
    # the probes reached the running process and counted its calls while attached
    p = blocks[1]
    assert p["traced_allocs"] > 0 and p["traced_allocs"] == pytest.approx(p["own_allocs"], rel=0.05)
    assert p["ready_s"] > 0 and p["off_s"] > 0
    # the method recovers the truth: the delay's interval contains it, in ratio and in us
    d = modes["delay"]
    assert d["truth_added_us"] == DELAY_US
    assert d["ratio_lo"] <= d["truth_ratio"] <= d["ratio_hi"], d
    assert d["added_lo_us"] <= DELAY_US <= d["added_hi_us"], d
    assert "ratio" in modes["probed"] and "ratio" not in modes["bare"]
    assert "delay:" in r.stdout and "probed" in r.stdout
    # its plot
    png = plot_toggle([(data, out)], tmp_path)
    assert png.stat().st_size > 10_000
