"""bench.breakdown on the real driver, small (issue 32 part 1): the driver-API loop's pair is
one cuMemAlloc_v2 and one cuMemFree_v2 there too (2 entries, 1 return: the free's is skipped far
from any limit, a uprobe session on kernel 6.18; 1 recheck under the enforcer: no call inside the
driver reaches another probed entry point), the tracer writes 2 ring
records and is not woken, the enforcer writes none of its own; PyTorch without its caching allocator makes
at least that many traps per tensor (its cudaMalloc/cudaFree are the runtime layer's).
Run on a GPU machine: pytest -m gpu tests/gpu/test_gpu_breakdown.py (about a minute)."""
import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu


def breakdown(tmp_path, workload: str) -> dict:
    out = tmp_path / f"{workload}.json"
    r = subprocess.run([sys.executable, "-m", "bench.breakdown", "--workload", workload, "--pairs", "3000",
                        "--rounds", "1", "--bystander", "2000", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    print("\n" + r.stdout)
    return {s["mode"]: s for s in json.loads(out.read_text())["steps"]}


def test_driver_pair_on_the_driver(root, tmp_path):
    by = breakdown(tmp_path, "driver")
    t = {m: {k: round(v, 3) for k, v in s["traps_per_pair"].items() if k != "tracepoints"} for m, s in by.items()}
    assert t["traps"] == {"empty": 4.0}
    assert t["drv-ret"] == {"driver entry": 2.0, "driver return": 1.0}
    assert t["enforced"] == {"driver entry": 2.0, "driver return": 1.0, "recheck": 1.0}
    assert by["drv-ret"]["ring_records_per_pair"] == 2.0 and by["drv-ret"]["wakeups_per_pair"] < 0.01
    # none of the pairs': the ring also carries any other process's discovery events on the
    # host (3 records in 3,000 pairs on the H100, 2026-11-27), never one per pair
    assert by["enforced"]["ring_records_per_pair"] < 0.01


def test_torch_pair_traps(root, tmp_path):
    by = breakdown(tmp_path, "torch")
    t = by["runtime"]["traps_per_pair"]
    assert t.get("driver entry", 0) >= 2 and t.get("driver return", 0) >= 1 and t.get("runtime", 0) >= 4, t
    assert "runtime" not in by["enforced"]["traps_per_pair"], by["enforced"]   # the enforcer probes the driver alone
