"""Statistics of bench.e2e_toggle: blocks of steps, each compared with its bare neighbours.

A block is one stretch of one mode; its value is the median of its step times (a stall or a
page fault in one step does not move it). A non-bare block's ratio is its median over the mean
of the medians of the bare blocks just before and after it (paired: a drift of the machine's
speed over minutes cancels, as the schedule puts bare on both sides of every other block).
Per mode, the mean of its blocks' ratios and a 95 % bootstrap interval of that mean
(percentile method, blocks resampled with replacement, seeded: the same data give the same
interval). The same for the added time per step (median minus the neighbours' mean).

The host's speed regimes (docs/BENCHMARKS.md, "The GPU machines' CPU regimes"): on the GPU
machines a fixed CPU-bound step runs at one speed or about 1.3-1.85x slower for seconds at a
time, pinned or not, in thread CPU time as in wall time, with no steal, in bare blocks as in
any other. A block that lands in the slow regime moves its ratio by tens of percent. So every
step also times a fixed piece of CPU work (bench/e2e_workloads.py `reference`), and a block's
`norm_median` is the median of its steps' times over their reference's: a time at one speed.
Per mode `norm_ratio` with its interval is the pairing above on those, and for the delay
`norm_truth_ratio` (the wait, a fixed wall time, over the block's reference, against bare's
normalized step). Per mode also its `slow_share`: the share of its steps slower than
SLOW_FACTOR x the 10th percentile of every bare step of the run; a mode with more of them
than bare either slows the host or drew the regime by chance (2026-11-27d: chance, 63 against
59 % in 31 blocks each). A ratio of the fast steps alone was tried and dropped: cutting at a
threshold biases a slower mode's fast median down, and it missed the injected delay twice."""
from __future__ import annotations

import random
import statistics

BARE = "bare"
SLOW_FACTOR = 1.25   # over this x bare's 10th percentile, a step ran in the slow regime


def _inside(ends: list[int], start_ns: int, stop_ns: int) -> list[int]:
    """The steps (index of the end stamp each began at) that began and ended inside the block."""
    return [i for i in range(len(ends) - 1) if ends[i] >= start_ns and ends[i + 1] <= stop_ns]


def steps_in(ends: list[int], start_ns: int, stop_ns: int, clock: list[int] | None = None) -> list[int]:
    """Durations (ns) of the steps that began and ended inside [start_ns, stop_ns]: a step is
    the time between two consecutive end stamps, read on `clock` (stamps taken with `ends`,
    e.g. the thread's CPU time) if given."""
    c = clock or ends
    return [c[i + 1] - c[i] for i in _inside(ends, start_ns, stop_ns)]


def refs_in(ends: list[int], refs: list[int], start_ns: int, stop_ns: int) -> list[int]:
    """The reference work's time of each step steps_in(ends, start_ns, stop_ns) returns, in
    the same order (a step's line carries its own)."""
    return [refs[i + 1] for i in _inside(ends, start_ns, stop_ns)]


def paired(blocks: list[dict], key: str = "median_ns") -> list[dict]:
    """For every non-bare block (dicts with `mode` and `key`, in the order they ran): `ref_ns`
    (mean of the neighbouring bare blocks' values), `ratio`, `added_ns`. A block without a bare
    block on either side (none ran), or without `key`, is left out."""
    out = []
    for i, b in enumerate(blocks):
        if b["mode"] == BARE or key not in b:
            continue
        before = next((x for x in reversed(blocks[:i]) if x["mode"] == BARE and key in x), None)
        after = next((x for x in blocks[i + 1:] if x["mode"] == BARE and key in x), None)
        refs = [x[key] for x in (before, after) if x is not None]
        if not refs:
            continue
        ref = statistics.fmean(refs)
        out.append({**b, "ref_ns": ref, "ratio": b[key] / ref, "added_ns": b[key] - ref, "neighbours": len(refs)})
    return out


def slow_shares(blocks: list[dict]) -> list[float | None]:
    """Per block, the share of its steps in the host's slow regime (module doc); None for a
    block without its steps' durations, or every block where no bare step was kept."""
    bare = sorted(x for b in blocks if b["mode"] == BARE for x in b.get("durations_ns") or ())
    if not bare:
        return [None] * len(blocks)
    limit = SLOW_FACTOR * bare[len(bare) // 10]
    return [sum(x >= limit for x in d) / len(d) if (d := b.get("durations_ns")) else None for b in blocks]


def bootstrap_mean(values: list[float], reps: int = 10000, level: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Percentile interval of the mean of `values` (resampled with replacement `reps` times).
    One value gives a zero-width interval at it: say how many blocks an interval rests on."""
    if not values:
        raise ValueError("no values to bootstrap")
    rng = random.Random(seed)
    n = len(values)
    means = sorted(sum(rng.choices(values, k=n)) / n for _ in range(reps))
    lo = means[int((1 - level) / 2 * reps)]
    hi = means[min(reps - 1, int((1 + level) / 2 * reps))]
    return lo, hi


def summarize(blocks: list[dict], reps: int = 10000) -> dict:
    """Per mode: blocks, steps, median step time (median of the block medians), and for every
    mode but bare the mean ratio to bare with its interval (`ratio_lo`, `ratio_hi`, `half_pct`:
    half the interval's width in percent of bare) and the same for the added time."""
    modes: dict = {}
    for b in blocks:
        m = modes.setdefault(b["mode"], {"blocks": 0, "steps": 0, "medians_ns": []})
        m["blocks"] += 1
        m["steps"] += b["steps"]
        m["medians_ns"].append(b["median_ns"])
    for m in modes.values():
        m["median_ms"] = statistics.median(m.pop("medians_ns")) / 1e6
    pairs = paired(blocks)
    for mode, m in modes.items():
        mine = [p for p in pairs if p["mode"] == mode]
        if mode == BARE or not mine:
            continue
        ratios = [p["ratio"] for p in mine]
        added = [p["added_ns"] / 1e3 for p in mine]
        m["ratio"] = statistics.fmean(ratios)
        m["ratio_lo"], m["ratio_hi"] = bootstrap_mean(ratios, reps)
        m["half_pct"] = 100 * (m["ratio_hi"] - m["ratio_lo"]) / 2
        m["added_us"] = statistics.fmean(added)
        m["added_lo_us"], m["added_hi_us"] = bootstrap_mean(added, reps)
        m["paired"] = len(mine)
    shares = slow_shares(blocks)
    norm = paired(blocks, "norm_median")
    for mode, m in modes.items():
        mine = [x for b, x in zip(blocks, shares) if b["mode"] == mode and x is not None]
        if mine:
            m["slow_share"] = statistics.fmean(mine)
        ratios = [p["ratio"] for p in norm if p["mode"] == mode]
        if ratios:
            m["norm_ratio"] = statistics.fmean(ratios)
            m["norm_lo"], m["norm_hi"] = bootstrap_mean(ratios, reps)
            m["norm_half_pct"] = 100 * (m["norm_hi"] - m["norm_lo"]) / 2
    return modes


def summarize_run(blocks: list) -> dict:
    """summarize, plus the allocation rate and the transitions' medians per mode, and
    the delay's truth (the injected wait over bare's step around each delay block)."""
    modes = summarize(blocks)
    for mode, m in modes.items():
        rates = [b.get("alloc_rate") or b.get("own_alloc_rate") for b in blocks if b["mode"] == mode]
        rates = [r for r in rates if r is not None]
        m["alloc_rate"] = statistics.median(rates) if rates else None
        for k in ("ready_s", "off_s", "detach_wait_s"):
            xs = [b[k] for b in blocks if b["mode"] == mode and k in b]
            if xs:
                m[k] = statistics.median(xs)
    delays = [p for p in paired(blocks) if p["mode"] == "delay"]
    if delays:
        modes["delay"]["truth_ratio"] = statistics.fmean(1 + p["delay_ns"] / p["ref_ns"] for p in delays)
        modes["delay"]["truth_added_us"] = statistics.fmean(p["delay_ns"] for p in delays) / 1e3
    norm = [p for p in paired(blocks, "norm_median") if p["mode"] == "delay" and "ref_median_ns" in p]
    if norm:
        modes["delay"]["norm_truth_ratio"] = statistics.fmean(
            1 + p["delay_ns"] / p["ref_median_ns"] / p["ref_ns"] for p in norm)
    return modes


def table(modes: dict) -> str:
    """Plain text: one row per mode."""
    rows = [f"{'mode':>9} {'blocks':>6} {'steps':>7} {'median ms':>10} {'ratio':>8} {'95% CI':>19} {'+/- %':>7}"
            f" {'added us':>9} {'allocs/s':>9} {'slow %':>6} {'norm':>7} {'norm 95% CI':>15} {'+/- %':>6}"]
    for mode, m in modes.items():
        ci = f"{m['ratio_lo']:.4f}-{m['ratio_hi']:.4f}" if "ratio" in m else "-"
        rate = f"{m['alloc_rate']:.0f}" if m.get("alloc_rate") is not None else "-"
        slow = f"{100 * m['slow_share']:.0f}" if "slow_share" in m else "-"
        norm = f"{m['norm_ratio']:.4f}" if "norm_ratio" in m else "-"
        nci = f"{m['norm_lo']:.4f}-{m['norm_hi']:.4f}" if "norm_ratio" in m else "-"
        rows.append(f"{mode:>9} {m['blocks']:>6} {m['steps']:>7} {m['median_ms']:>10.4f} {m.get('ratio', 1.0):>8.4f}"
                    f" {ci:>19} {m.get('half_pct', 0.0):>7.3f} {m.get('added_us', 0.0):>9.2f} {rate:>9}"
                    f" {slow:>6} {norm:>7} {nci:>15} {m.get('norm_half_pct', 0.0):>6.3f}")
    return "\n".join(rows)
