"""Added latency on cuMemAlloc_v2 / cuMemFree_v2, as ratios to bare measured in one run:
probed (the tracer attached), enforced (`convgpu enforce` running, nothing stalls) and shim
(the preload shim under that enforcer: one round trip to it per allocation).

    python -m bench.probe_latency [--standin] [--sizes 4K,64K,1M,2M,16M,64M] [--iters 2000]
                                     [--rounds 5] [--modes bare,probed,enforced,shim]

The modes alternate within each round (attach, measure, detach, again), so drift of the machine
hits all alike. Each cell is the median over rounds of the per-call median; the JSON also has
the median over rounds of the per-call p99 (`p99_us`), printed below the table.
Without --standin the real driver is used (the GPU machine); with it, build/standin."""
import argparse
import json
import os
import statistics
import subprocess
import sys

from convgpu.paths import build_dir
from convgpu.units import format_size, parse_size

from bench.modes import running


def run_bench(size: int, iters: int, env: dict) -> dict:
    iters = max(50, min(iters, (8 << 30) // size))   # all are held at once: stay under 8 GiB
    out = subprocess.run([str(build_dir() / "alloc_bench"), str(size), str(iters)], env=env,
                         capture_output=True, text=True, check=True).stdout.split()
    return {out[i]: int(out[i + 1]) for i in range(0, len(out), 2)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--standin", action="store_true")
    ap.add_argument("--sizes", default="4K,64K,1M,2M,16M,64M")
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--modes", default="bare,probed,enforced,shim")
    ap.add_argument("--json", help="write raw results here")
    a = ap.parse_args(argv)
    sizes = [parse_size(s) for s in a.sizes.split(",")]
    env = dict(os.environ)
    libs: tuple = ()
    if a.standin:
        env["LD_LIBRARY_PATH"] = str(build_dir() / "standin")
        libs = (str(build_dir() / "standin" / "libcuda.so.1"),)
    modes = a.modes.split(",")
    res: dict = {m: {s: [] for s in sizes} for m in modes}
    for r in range(a.rounds):
        for mode in modes:
            with running(mode, libs, a.standin) as (extra, tracer):
                for s in sizes:
                    res[mode][s].append(run_bench(s, a.iters, {**env, **extra}))
                    if tracer:
                        tracer.poll()
        print(f"round {r + 1}/{a.rounds} done", file=sys.stderr)
    rows = []
    print(f"{'size':>10} {'op':>5} {'bare us':>9} " + " ".join(f"{m + ' +us':>12} {'x':>6}" for m in modes[1:]))
    for s in sizes:
        row = {"size": s}
        for op in ("alloc", "free"):
            med = {m: statistics.median(x[f"{op}_ns"] for x in res[m][s]) / 1000 for m in modes}
            p99 = {m: statistics.median(x[f"p99_{op}_ns"] for x in res[m][s]) / 1000 for m in modes}
            row[op] = {m: {"us": med[m], "added_us": med[m] - med["bare"], "ratio": med[m] / med["bare"],
                           "p99_us": p99[m]} for m in modes}
            print(f"{format_size(s):>10} {op:>5} {med['bare']:>9.2f} " +
                  " ".join(f"{med[m] - med['bare']:>12.2f} {med[m] / med['bare']:>6.2f}" for m in modes[1:]))
        rows.append(row)
    print("p99 us: " + "; ".join(f"{format_size(r['size'])} {op} " + " ".join(
        f"{m} {r[op][m]['p99_us']:.2f}" for m in modes) for r in rows for op in ("alloc", "free")))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"iters": a.iters, "rounds": a.rounds, "standin": a.standin, "modes": modes, "rows": rows},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
