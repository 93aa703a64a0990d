"""What the banker's check costs each policy: the simulator before it (the policies and
simulator of a git revision) and now, on the same workloads, paired by seed.

    .venv/bin/python -m bench.sched.safety_cost [--before bc9d386] [--seeds 500] [--n 4,10,16,22,30,38]

For every (context overhead, N, policy): how many runs deadlocked before and now, and the mean
difference now - before (95 % CI, Student's t) of makespan, mean and p95 suspended time over
the seeds that finished both ways. A run that deadlocked before has no makespan, so those
seeds drop out of the pairs; the survivors are the easier workloads, which is why the pairs
are the fair measure and the unpaired means of docs/img/sched/before-safety/ are not.
Writes safety-cost.json and .md to --out."""
from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .sim import simulate
from .simulate import parse_ns, parse_overheads
from .stats import mean_ci
from .workload import generate

METRICS = ("makespan", "mean_suspended", "p95_suspended")
ROOT = Path(__file__).resolve().parents[2]
_before = None   # the old simulate(), loaded once per process


def load_before(rev: str):
    """simulate() of `rev`: its enforcer/policies.py and bench/sched/sim.py as modules of their
    own (the sim's `policies` is the old one; workload and the rest are today's)."""
    tmp = Path(tempfile.mkdtemp(prefix="safety-cost-"))
    mods = {}
    for path, name in (("enforcer/policies.py", "policies_before"), ("bench/sched/sim.py", "sim_before")):
        src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{path}"], check=True,
                             capture_output=True, text=True).stdout
        if name == "sim_before":   # the old simulator on the old policies
            src = src.replace("from convgpu.enforcer import policies", "from bench.sched import policies_before as policies")
        (tmp / f"{name}.py").write_text(src)
        spec = importlib.util.spec_from_file_location(f"bench.sched.{name}", tmp / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        import bench.sched
        setattr(bench.sched, name, mod)
        spec.loader.exec_module(mod)
        mods[name] = mod
    return mods["sim_before"].simulate


def cell(args) -> tuple:
    global _before
    rev, oname, ov, n, policy, seeds = args
    if _before is None:
        _before = load_before(rev)
    old, new = [], []
    for seed in range(seeds):
        jobs = generate(n, seed)
        old.append(_before(jobs, policy, ov, seed=seed))
        new.append(simulate(jobs, policy, ov, seed=seed))
    pairs = [(b, a) for b, a in zip(old, new) if not b.deadlocked and not a.deadlocked]
    row = {"runs": seeds, "deadlocks_before": sum(bool(r.deadlocked) for r in old),
           "deadlocks_now": sum(bool(r.deadlocked) for r in new), "pairs": len(pairs)}
    for m in METRICS:
        row[m] = {"before": mean_ci(getattr(b, m) for b, _ in pairs),
                  "now": mean_ci(getattr(a, m) for _, a in pairs),
                  "now_minus_before": mean_ci(getattr(a, m) - getattr(b, m) for b, a in pairs),
                  "now_all": mean_ci(getattr(a, m) for a in new)}
    return oname, n, policy, row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default="bc9d386", help="git revision before the check")
    ap.add_argument("--seeds", type=int, default=500)
    ap.add_argument("--n", default="4,10,16,22,30,38")
    ap.add_argument("--policies", default="ru,rand")
    ap.add_argument("--overheads", default="paper,h100")
    ap.add_argument("--out", default="docs/img/sched")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    a = ap.parse_args(argv)
    ns, overheads = parse_ns(a.n), parse_overheads(a.overheads)
    cells = [(a.before, o, ov, n, p, a.seeds) for o, ov in overheads.items() for n in ns
             for p in a.policies.split(",")]
    t0 = time.monotonic()
    with multiprocessing.Pool(a.jobs) as pool:
        rows = pool.map(cell, sorted(cells, key=lambda c: -c[3]))
    res: dict = {}
    for oname, n, policy, row in rows:
        res.setdefault(oname, {}).setdefault(str(n), {})[policy] = row
    res = {o: {str(n): res[o][str(n)] for n in ns} for o in overheads}
    meta = {"before": a.before, "seeds": a.seeds, "ns": ns, "overheads": overheads,
            "date": time.strftime("%Y-%m-%d"), "wall_s": round(time.monotonic() - t0, 1),
            "command": "python -m bench.sched.safety_cost " + " ".join(argv if argv is not None else sys.argv[1:])}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "safety-cost.json").write_text(json.dumps({"meta": meta, "results": res}, indent=1))
    lines = ["| context | N | policy | deadlocked before | now | pairs | makespan before -> now (s) | "
             "mean susp. | p95 susp. |", "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for oname, by_n in res.items():
        for n, by_p in by_n.items():
            for p, r in by_p.items():
                f = lambda m: (f"{r[m]['before']['mean']:.0f} -> {r[m]['now']['mean']:.0f} "
                               f"({r[m]['now_minus_before']['mean']:+.1f} ± {r[m]['now_minus_before']['ci']:.1f})")
                lines.append(f"| {oname} | {n} | {p} | {r['deadlocks_before']} | {r['deadlocks_now']} | "
                             f"{r['pairs']} | {f('makespan')} | {f('mean_suspended')} | {f('p95_suspended')} |")
    md = "\n".join(lines) + "\n"
    (out / "safety-cost.md").write_text(md)
    print(md)
    print(f"{meta['wall_s']} s; wrote {out / 'safety-cost.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
