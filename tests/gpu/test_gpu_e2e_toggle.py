"""bench.e2e_toggle on the real driver, small: PyTorch without its caching allocator (every
tensor a cuMemAlloc_v2 and a cuMemFree_v2) under probed, enforced and a 1 % injected delay,
switched under one running process. Shapes and truth: the tracer counts the running process's
allocations, the enforcer places it and leaves it running, the delay is seen and recovered.
Run on a GPU machine: pytest -m gpu tests/gpu/test_gpu_e2e_toggle.py (about 2 minutes)."""
import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu


def test_toggled_modes_under_a_running_pytorch_process(root, tmp_path):
    from bench import e2e_stats
    out = tmp_path / "e2e.json"
    r = subprocess.run([sys.executable, "-P", "-m", "bench.e2e_toggle", "torch", "--no-caching", "--blocks", "5",
                        "--modes", "probed,enforced,delay,delay,delay", "--block", "6", "--settle", "1",
                        "--delay-frac", "0.01", "--minutes", "6", "--json", str(out), "--", "--batch", "32"],
                       cwd="/", capture_output=True, text=True, timeout=600)   # not the source tree: -P
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(out.read_text())
    blocks, modes = data["blocks"], data["modes"]
    print("\n" + r.stdout)
    assert data["dropped"] == [] and [b["mode"] for b in blocks] == [
        "bare", "probed", "bare", "enforced", "bare", "delay", "bare", "delay", "bare", "delay", "bare"]
    probed, enforced = blocks[1], blocks[3]
    assert probed["traced_allocs"] > 0 and probed["alloc_rate"] > 0   # every tensor a driver allocation
    assert enforced["placed_s"] is not None and not enforced.get("left_stopped")
    assert enforced["containers"] and all(c["used"] <= c["limit"] for c in enforced["containers"])
    d = modes["delay"]
    pairs = [p for p in e2e_stats.paired(blocks) if p["mode"] == "delay"]
    lo, hi = e2e_stats.bootstrap_mean([p["ratio"] for p in pairs], level=0.999)
    assert lo <= d["truth_ratio"] <= hi and d["ratio_lo"] > 1.0, d
