"""bench.seized on the stand-in (issue 32): the workload's every thread seized as the enforcer's
holder seizes, each stop counted by kind. The stand-in driver's pairs make none; K signals
sent to the seized workload make exactly K signal-delivery-stops, each passed on (the workload
ignores SIGWINCH and runs on); every thread is detached after."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.system


def test_a_seized_workload_s_stops_are_counted_by_kind(root, build, tmp_path):
    out = tmp_path / "seized.json"
    r = subprocess.run([sys.executable, "-m", "bench.seized", "--standin", "--pairs", "2000", "--signals", "7",
                        "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads(out.read_text())
    assert d["workload"] == "driver" and d["seized_threads"] == d["threads"] >= 1
    assert d["stops"] == {"signal SIGWINCH": 7}, d["stops"]
    assert d["bare_ns_per_pair"] > 0 and d["seized_ns_per_pair"] > 0
    assert "signal SIGWINCH 7" in r.stdout
