"""bench/e2e_stats.py: the toggled end-to-end method's statistics, on worked examples and on the
stand-in run recorded in docs/cpu-runs/2026-11-25/e2e-standin (no root, no kernel, no GPU)."""
import json
import statistics
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))   # bench/ lives at the repo root
from bench import e2e_stats  # noqa: E402
from bench.e2e_toggle import schedule  # noqa: E402

RECORDED = REPO / "docs" / "cpu-runs" / "2026-11-25" / "e2e-standin" / "e2e_toggle.json"


def blk(mode, median, steps=10):
    return {"mode": mode, "median_ns": median, "steps": steps}


def test_a_step_counts_only_if_it_began_and_ended_inside_the_block():
    ends = [0, 10, 25, 30, 50]
    assert e2e_stats.steps_in(ends, 10, 30) == [15, 5]
    assert e2e_stats.steps_in(ends, 5, 49) == [15, 5]      # 0->10 began before, 30->50 ended after
    assert e2e_stats.steps_in(ends, 0, 50) == [10, 15, 5, 20]
    assert e2e_stats.steps_in(ends, 11, 24) == []
    assert e2e_stats.steps_in(ends, 10, 30, clock=[0, 7, 9, 16, 20]) == [2, 7]   # CPU time: windows stay wall


def test_each_block_is_paired_with_the_mean_of_its_bare_neighbours():
    blocks = [blk("bare", 100), blk("probed", 105), blk("bare", 100), blk("enforced", 102), blk("bare", 102),
              blk("enforced", 110)]   # the last has one bare neighbour only
    p = e2e_stats.paired(blocks)
    assert [(x["mode"], x["ref_ns"], x["neighbours"]) for x in p] == [
        ("probed", 100, 2), ("enforced", 101, 2), ("enforced", 102, 1)]
    assert [x["ratio"] for x in p] == [1.05, 102 / 101, 110 / 102]
    assert [x["added_ns"] for x in p] == [5, 1, 8]
    assert e2e_stats.paired([blk("probed", 5)]) == []   # no bare block ran: nothing to compare


def test_a_linear_drift_of_the_machine_cancels():
    """Bare speeds up 1 % per block; the mode adds exactly 2 % of the time of its moment."""
    blocks = [blk("bare" if i % 2 == 0 else "probed", (1000 - 10 * i) * (1.02 if i % 2 else 1.0)) for i in range(9)]
    m = e2e_stats.summarize(blocks)["probed"]
    assert m["ratio"] == pytest.approx(1.02)
    assert m["ratio_lo"] == pytest.approx(1.02) and m["ratio_hi"] == pytest.approx(1.02)
    assert m["half_pct"] == pytest.approx(0.0, abs=1e-9)


def test_bootstrap_of_two_values_is_their_range():
    """Means of 2 draws from {0, 1}: 0 (1/4), 0.5 (1/2), 1 (1/4): the 2.5th and 97.5th percentiles
    are the extremes; one value gives a zero-width interval at it."""
    assert e2e_stats.bootstrap_mean([0.0, 1.0]) == (0.0, 1.0)
    assert e2e_stats.bootstrap_mean([3.0]) == (3.0, 3.0)
    with pytest.raises(ValueError):
        e2e_stats.bootstrap_mean([])


def test_bootstrap_interval_narrows_as_blocks_add_up_and_is_seeded():
    vals = [1.0 + 0.01 * ((7 * i) % 5 - 2) for i in range(40)]   # spread +-2 %, mean 1.0
    lo10, hi10 = e2e_stats.bootstrap_mean(vals[:10])
    lo40, hi40 = e2e_stats.bootstrap_mean(vals)
    assert lo40 < statistics.fmean(vals) < hi40
    assert hi40 - lo40 < hi10 - lo10
    # the standard error of the mean of 40 values with sd s is s/sqrt(40); 95 %: about +-1.96 of it
    se = statistics.pstdev(vals) / 40 ** 0.5
    assert (hi40 - lo40) / 2 == pytest.approx(1.96 * se, rel=0.15)
    assert e2e_stats.bootstrap_mean(vals) == (lo40, hi40)


def test_summary_per_mode():
    blocks = [blk("bare", 100, 5), blk("delay", 110, 6), blk("bare", 100, 5), blk("delay", 112, 6), blk("bare", 100, 5)]
    s = e2e_stats.summarize(blocks)
    assert s["bare"] == {"blocks": 3, "steps": 15, "median_ms": 100 / 1e6}
    d = s["delay"]
    assert (d["blocks"], d["steps"], d["paired"], d["median_ms"]) == (2, 12, 2, 111 / 1e6)
    assert d["ratio"] == pytest.approx(1.11) and (d["ratio_lo"], d["ratio_hi"]) == pytest.approx((1.10, 1.12))
    assert d["half_pct"] == pytest.approx(1.0) and d["added_us"] == pytest.approx(0.011)
    lines = e2e_stats.table(s).splitlines()
    assert len(lines) == 3 and lines[2].split()[:5] == ["delay", "2", "12", "0.0001", "1.1100"]


def test_schedule_gives_every_mode_bare_neighbours_in_balanced_order():
    it = schedule(["probed", "enforced"])
    assert [next(it) for _ in range(12)] == ["bare", "probed", "bare", "enforced", "bare", "enforced", "bare", "probed",
                                            "bare", "probed", "bare", "enforced"]


def test_recorded_standin_run_recomputes_to_its_summary():
    """The CPU machine's validation run: its blocks give the summary it printed, bare blocks
    alternate with the others, and the injected delay lies inside its interval."""
    data = json.loads(RECORDED.read_text())
    blocks = data["blocks"]
    assert [b["mode"] == "bare" for b in blocks] == [i % 2 == 0 for i in range(len(blocks))]
    again = e2e_stats.summarize(blocks)
    for mode, m in again.items():
        for k, v in m.items():
            assert data["modes"][mode][k] == pytest.approx(v), (mode, k)
    d = data["modes"]["delay"]
    assert d["ratio_lo"] <= d["truth_ratio"] <= d["ratio_hi"]
    assert d["added_lo_us"] <= d["truth_added_us"] <= d["added_hi_us"]



def tblk(mode, fast, slow, step, factor=1.8):
    """A block of `fast` steps of `step` ns and `slow` of factor x that (the host's slow regime)."""
    d = [step] * fast + [round(step * factor)] * slow
    return {"mode": mode, "median_ns": statistics.median(d), "steps": len(d), "durations_ns": d}


def test_each_mode_s_share_of_steps_in_the_host_s_slow_regime():
    """Bare steps take 1,000 ns fast and 1,800 slow; probed adds 2 %, not enough to count as
    slow (the line is 1.25 x bare's 10th percentile). The shares are the blocks' own, averaged
    per mode; a block without its steps' durations has none."""
    blocks = [tblk("bare", 10, 0, 1000), tblk("probed", 8, 2, 1020), tblk("bare", 10, 0, 1000),
              tblk("probed", 0, 10, 1020), tblk("bare", 3, 7, 1000), tblk("probed", 10, 0, 1020),
              tblk("bare", 10, 0, 1000)]
    assert e2e_stats.slow_shares(blocks) == [0, 0.2, 0, 1.0, 0.7, 0, 0]
    m = e2e_stats.summarize(blocks)
    assert m["probed"]["slow_share"] == pytest.approx(0.4) and m["bare"]["slow_share"] == pytest.approx(0.175)
    m = e2e_stats.summarize([blk("bare", 100), blk("probed", 105), blk("bare", 100)])
    assert m["probed"]["ratio"] == pytest.approx(1.05) and "slow_share" not in m["probed"]


def test_steps_over_their_reference_work_cancel_the_host_s_regime():
    """Steps of 1,000 ns whose reference work takes 100 ns, and in the host's slow regime 1,800
    and 180 (the whole CPU at 1/1.8 speed); probed adds 2 % at either speed. A probed block
    wholly in the slow regime between fast bare blocks: its median ratio says +83.6 %, over its
    reference +2 %. A delay block waits 40 ns of wall time more per step in the slow regime:
    its truth, over its reference, is 40 / 180 / 10."""
    from types import SimpleNamespace

    from bench.e2e_toggle import block_of

    def run(mode, n, step, ref, t0):
        ends = [t0 + i * step for i in range(n + 1)]
        return SimpleNamespace(ends=ends, allocs=[0] * len(ends), cpu=[0] * len(ends), refs=[ref] * len(ends),
                               clock="wall"), ends[0], ends[-1]

    blocks = []
    for mode, step, ref, extra in (("bare", 1000, 100, {}), ("probed", 1836, 180, {}), ("bare", 1000, 100, {}),
                                   ("delay", 1840, 180, {"delay_ns": 40}), ("bare", 1000, 100, {})):
        w, a, b = run(mode, 20, step, ref, 10**6 * len(blocks))
        blocks.append(block_of(w, mode, a, b, **extra))
    assert [b["steps"] for b in blocks] == [20] * 5
    m = e2e_stats.summarize_run(blocks)
    assert m["probed"]["ratio"] == pytest.approx(1.836) and m["probed"]["norm_ratio"] == pytest.approx(1.02)
    assert m["delay"]["norm_ratio"] == pytest.approx(1840 / 180 / 10)
    assert m["delay"]["norm_truth_ratio"] == pytest.approx(1 + 40 / 180 / 10)
    assert m["probed"]["slow_share"] == 1.0 and m["bare"]["slow_share"] == 0.0
    assert "norm_ratio" not in m["bare"]
