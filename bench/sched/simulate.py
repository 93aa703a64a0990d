"""The scheduling experiment in the simulator: every (overhead, N, policy) over many seeds.

    .venv/bin/python -m bench.sched.simulate [--seeds 500] [--n 4:38:2] [--out docs/img/sched]

Each seed is one workload (bench/sched/workload.py) that every policy runs, so policies are
compared on the same containers (paired differences, with their own intervals). Writes
simulate.json (all aggregates), simulate.md (the tables) and, with matplotlib installed (the
`bench` extra), PNG plots to --out. The whole default table takes about 400 s of CPU, twice
what it took before the banker's check before every move (policies.safe_assignment); --jobs
spreads the (overhead, N) cells over processes (default: one per CPU)."""
from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import sys
import time
from pathlib import Path

from rich.progress import Progress

from convgpu.enforcer import policies
from convgpu.units import format_size, parse_size

from .sim import simulate
from .stats import mean_ci
from .workload import OVERHEADS, generate

MAX_DEADLOCKED = 0.1
METRICS = ("makespan", "mean_suspended", "p95_suspended", "max_suspended")
PAPER_POLICIES = ("fifo", "bf", "ru", "rand")


def parse_ns(text: str) -> list[int]:
    """"4:38:2" (inclusive) or "4,10,38"."""
    if ":" in text:
        a, b, step = (int(x) for x in text.split(":"))
        return list(range(a, b + 1, step))
    return [int(x) for x in text.split(",")]


def parse_overheads(text: str) -> dict[str, int]:
    """"paper,h100" (named in workload.OVERHEADS) or sizes such as "0,66MiB"."""
    out = {}
    for item in text.split(","):
        out[item] = OVERHEADS[item] if item in OVERHEADS else parse_size(item, "--overheads")
    return out


def variants(policies: list[str], max_waits: list[float]) -> list[tuple[str, str, float]]:
    """(label, policy, max_wait); bfa once per max_wait, labelled bfa@W when there are several."""
    out = []
    for p in policies:
        if p == "bfa" and len(max_waits) > 1:
            out += [(f"bfa@{w:g}", p, w) for w in max_waits]
        else:
            out.append((p, p, max_waits[0]))
    return out


def aggregate(runs: dict[str, list], base: str | None) -> dict:
    """runs: label -> [Result per seed, same seed order]. Means over the runs that finished;
    deadlocks counted apart (a deadlocked run has no makespan). Paired differences against
    `base` over the seeds both finished."""
    out = {}
    for label, rs in runs.items():
        ok = [r for r in rs if not r.deadlocked]
        row = {"runs": len(rs), "deadlocks": len(rs) - len(ok)}
        for m in METRICS:
            row[m] = mean_ci(getattr(r, m) for r in ok)
        if base and base in runs and label != base:
            pairs = [(r, b) for r, b in zip(rs, runs[base]) if not r.deadlocked and not b.deadlocked]
            row[f"minus_{base}"] = {m: mean_ci(getattr(r, m) - getattr(b, m) for r, b in pairs)
                                    for m in METRICS}
        out[label] = row
    return out


def run_cell(oname: str, ov: int, n: int, labels, seeds: int) -> tuple[str, int, dict]:
    """Every label on the first `seeds` workloads of N = n containers: one table cell per label."""
    runs: dict = {label: [] for label, _, _ in labels}
    for seed in range(seeds):
        jobs = generate(n, seed)
        for label, policy, mw in labels:
            r = simulate(jobs, policy, ov, seed=seed, max_wait=mw)
            assert r.peak_assigned <= 5 << 30, (label, n, seed)   # never over capacity
            runs[label].append(r)
    agg = aggregate(runs, "bf")
    fifo = aggregate({k: v for k, v in runs.items() if k in ("fifo",) or k.startswith("bfa")}, "fifo")
    for k, row in fifo.items():
        if "minus_fifo" in row:
            agg[k]["minus_fifo"] = row["minus_fifo"]
    return oname, n, agg


def _cell(args):
    return run_cell(*args)


def run_all(ns, overheads, labels, seeds, progress=None, jobs: int = 1) -> dict:
    cells = [(oname, ov, n, labels, seeds) for oname, ov in overheads.items() for n in ns]
    task = progress.add_task("simulating", total=len(cells)) if progress else None
    done = {}
    # the largest N first: the cells' costs grow with N, so the pool ends together
    order = sorted(cells, key=lambda c: -c[2])
    with multiprocessing.Pool(jobs) if jobs > 1 else _Serial() as pool:
        for oname, n, agg in pool.imap_unordered(_cell, order):
            done[oname, n] = agg
            if progress:
                progress.advance(task)
    return {oname: {str(n): done[oname, n] for n in ns} for oname in overheads}


class _Serial:
    """multiprocessing.Pool's imap_unordered, in this process (--jobs 1; tests)."""
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    @staticmethod
    def imap_unordered(fn, items):
        return map(fn, items)


def fmt(c: dict, digits: int = 0) -> str:
    if not math.isfinite(c["mean"]):
        return "-"
    return f"{c['mean']:.{digits}f} ± {c['ci']:.{digits}f}"


def tables(results: dict, labels: list[str], meta: dict) -> str:
    """Markdown: per overhead, one table per metric (rows N, columns policies), like the paper's
    Tables IV-V; a cell is mean ± 95 % CI half-width in seconds over the runs that finished;
    with more than 10 % of the runs deadlocked it says how many instead (the survivors' mean
    would describe only the easy workloads)."""
    lines = []
    for oname, by_n in results.items():
        ov = meta["overheads"][oname]
        runs = next(iter(next(iter(by_n.values())).values()))["runs"]
        lines += [f"**runs deadlocked (of {runs}), context overhead {format_size(ov)} ({oname})**", "",
                  "| N | " + " | ".join(labels) + " |", "|---:|" + "---:|" * len(labels)]
        lines += [f"| {n} | " + " | ".join(str(agg[lab]["deadlocks"]) for lab in labels) + " |"
                  for n, agg in by_n.items()]
        lines.append("")
        for m, title in (("makespan", "makespan (s)"), ("mean_suspended", "mean suspended time (s)"),
                         ("p95_suspended", "p95 suspended time (s)")):
            lines += [f"**{title}, context overhead {format_size(ov)} ({oname})**", "",
                      "| N | " + " | ".join(labels) + " |", "|---:|" + "---:|" * len(labels)]
            for n, agg in by_n.items():
                cells = []
                for lab in labels:
                    row = agg[lab]
                    if row["deadlocks"] > MAX_DEADLOCKED * row["runs"]:   # survivors only: no mean
                        cells.append(f"deadlock {row['deadlocks']}/{row['runs']}")
                        continue
                    cell = fmt(row[m])
                    if row["deadlocks"]:
                        cell += f" ({row['deadlocks']} deadlocked)"
                    cells.append(cell)
                lines.append(f"| {n} | " + " | ".join(cells) + " |")
            lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=500)
    ap.add_argument("--n", default="4:38:2", help="container counts: A:B:STEP or a list")
    ap.add_argument("--policies", default="fifo,bf,ru,rand,bfa")
    ap.add_argument("--overheads", default="paper,h100", help="paper (66 MiB), h100 (519 MiB) or sizes")
    ap.add_argument("--max-wait", default=f"{policies.MAX_WAIT:g}",
                    help="bfa's --max-wait in s; a list (30,180,inf) runs bfa once per value")
    ap.add_argument("--out", default="docs/img/sched")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="processes")
    a = ap.parse_args(argv)
    ns, overheads = parse_ns(a.n), parse_overheads(a.overheads)
    labels = variants(a.policies.split(","), [float(x) for x in a.max_wait.split(",")])
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0, w0 = time.process_time(), time.monotonic()
    with Progress(transient=True) as progress:
        results = run_all(ns, overheads, labels, a.seeds, progress, a.jobs)
    children = os.times()   # the pool's workers, once they are gone
    cpu = time.process_time() - t0 + children.children_user + children.children_system
    meta = {"seeds": a.seeds, "ns": ns, "overheads": overheads,
            "labels": {lab: {"policy": p, "max_wait": w} for lab, p, w in labels},
            "date": time.strftime("%Y-%m-%d"), "cpu_s": round(cpu, 1),
            "wall_s": round(time.monotonic() - w0, 1), "jobs": a.jobs,
            "command": "python -m bench.sched.simulate " + " ".join(argv if argv is not None else sys.argv[1:])}
    (out / "simulate.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    md = tables(results, [lab for lab, _, _ in labels], meta)
    (out / "simulate.md").write_text(md)
    print(md)
    if not a.no_plots:
        try:
            from .plots import plot_simulation
        except ImportError as e:   # matplotlib is the optional `bench` extra
            print(f"no plots ({e}): pip install -e '.[bench]'", file=sys.stderr)
        else:
            for f in plot_simulation(results, meta, out):
                print(f"wrote {f}", file=sys.stderr)
    print(f"{meta['cpu_s']} s of CPU, {meta['wall_s']} s on {a.jobs} processes; wrote "
          f"{out / 'simulate.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
