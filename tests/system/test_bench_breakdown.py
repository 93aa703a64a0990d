"""bench.breakdown on the stand-in (issue 32 part 1): one short run per workload, the JSON's
shape, and the counts per pair that must be exact whatever the machine's speed: every pair is
one cuMemAlloc_v2 and one cuMemFree_v2, so 2 driver entries and 1 return (a free's return is
skipped far from any limit: a uprobe session, bpf free_session), 4 empty-program
traps where those are all that is attached, 1 recheck (the enforcer's probe inside the
allocation's prologue), 2 ring records for the tracer (alloc and free) and none for an
enforcer that no view asked for events (bpf quiet()); through the runtime, 2 more traps at
entry and 2 at return for the tracer, none for the enforcer (it probes the driver alone). The times are the machine's and are only checked to be there."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.system
MODES = ["bare", "traps", "drv-entry", "drv-ret", "runtime", "enforced"]


def run(tmp_path, workload: str) -> dict:
    out = tmp_path / f"{workload}.json"
    p = subprocess.run([sys.executable, "-m", "bench.breakdown", "--standin", "--workload", workload,
                        "--pairs", "1500", "--rounds", "1", "--bystander", "500", "--json", str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "remainder" in p.stdout and p.stdout.splitlines()[1].split()[:3] == ["mode", "pair", "step"]
    return json.loads(out.read_text())


def traps(res: dict) -> dict:
    return {s["mode"]: {k: round(v, 6) for k, v in s["traps_per_pair"].items() if k != "tracepoints"}
            for s in res["steps"]}


def test_pair_counts_are_exact(root, build, tmp_path):
    """One run (each run costs ~10 s of attaches and an enforcer start): the runtime loop, whose
    cudaMalloc/cudaFree call the stand-in driver's cuMemAlloc_v2/cuMemFree_v2."""
    res = run(tmp_path, "runtime")
    assert [s["mode"] for s in res["steps"]] == MODES and res["hold"] == 1
    drv = {"driver entry": 2.0, "driver return": 1.0}
    assert traps(res) == {
        "bare": {}, "traps": {"empty": 8.0},   # entry and return of the two runtime and two driver calls
        "drv-entry": {"driver entry": 2.0},
        "drv-ret": drv,
        "runtime": {**drv, "runtime": 4.0},
        "enforced": {**drv, "recheck": 1.0}}   # the enforcer leaves the runtime unprobed
    by = {s["mode"]: s for s in res["steps"]}
    progs = by["runtime"]["programs"]
    assert {k: v["runs_per_pair"] for k, v in progs.items() if not k.startswith(("syscalls", "sched"))} == {
        "enter_cuMemAllo": 1.0, "sess_cuMemFree_": 1.0, "exit_alloc": 1.0,
        "enter_cudaMallo": 1.0, "enter_cudaFree": 1.0, "exit_runtime": 2.0}
    assert by["drv-entry"]["ring_records_per_pair"] == 0      # entries record nothing
    assert by["drv-ret"]["ring_records_per_pair"] == 2.0      # alloc and free, at return
    assert by["drv-ret"]["events_per_pair"] == 2.0            # and the tracer read both
    assert by["drv-ret"]["wakeups_per_pair"] < 0.01           # BPF_RB_NO_WAKEUP: read at its poll
    assert by["enforced"]["ring_records_per_pair"] == 0       # quiet: the books are in maps
    e = by["enforced"]["enforcer"]
    assert e["cpu_ns_per_pair"] >= 0 and e["switches_per_pair"] >= 0 and e["cpus"]
    # per thread, by the names the kernel knows them by (convgpu/threads.py): they add up
    assert {"convgpu-beat", "convgpu-ptrace"} <= set(e["threads"]), e["threads"]
    assert sum(t["switches_per_pair"] for t in e["threads"].values()) == pytest.approx(e["switches_per_pair"])
    assert sum(t["cpu_ns_per_pair"] for t in e["threads"].values()) == pytest.approx(e["cpu_ns_per_pair"])
    for s in res["steps"]:
        assert s["pair_ns"] > 0 and s["openat_ns"] > 0 and s["fork_exit_ns"] > 0
    m = res["model"]
    assert m["traps_per_pair"] == 4.0 and m["predicted_ns"] == pytest.approx(m["traps_ns"] + m["bpf_ns"])
    assert res["remainder_ns"] == pytest.approx(res["total_ns"] - m["predicted_ns"])


def test_the_workload_keeps_its_held_blocks_for_its_life(root, build, private_copy):
    """HOLD blocks of the first size, allocated before the warm-up and never freed: on a real
    driver the device page stays mapped and each timed pair is a sub-allocation. Counted by a
    tracer on a private copy of the stand-in: 2 held + 1,000 warm-up + 50 timed allocations,
    every one but the 2 freed, 2 x 4 KiB live."""
    import os

    from convgpu.probes.tracer import Tracer
    t = Tracer(libraries=(str(private_copy),), discover=False, selftest=False).start()
    w = subprocess.Popen([sys.executable, "-m", "bench.breakdown_child", "pairs", "driver", "4096", "2"], cwd=REPO,
                         env={**os.environ, "BREAKDOWN_LIBCUDA": str(private_copy)},
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert w.stdout.readline().split()[0] == "ready"
        w.stdin.write("50\n")
        w.stdin.flush()
        assert len(w.stdout.readline().split()) == 2
        rows = [(u.n_alloc, u.n_free, u.live) for u in t.usage() if u.pid == w.pid]
        assert rows == [(1052, 1050, 2 * 4096)]
    finally:
        w.kill()
        w.wait()
        t.close()
