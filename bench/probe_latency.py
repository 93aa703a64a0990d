"""Added latency of the probes on cuMemAlloc_v2 / cuMemFree_v2, as ratios measured in one run.

    python bench/probe_latency.py [--standin] [--sizes 4K,64K,1M,2M,16M,64M] [--iters 2000] [--rounds 5]

Bare and probed rounds alternate (the tracer is attached, measured, detached, again), so drift
of the machine hits both alike. Each cell is the median over rounds of the per-call median.
Without --standin the real driver is used (the GPU machine); with it, build/standin."""
import argparse
import json
import os
import statistics
import subprocess
import sys

from convgpu.paths import build_dir
from convgpu.probes.tracer import Tracer
from convgpu.units import format_size, parse_size


def run_bench(size: int, iters: int, env: dict) -> dict:
    iters = max(50, min(iters, (8 << 30) // size))   # all are held at once: stay under 8 GiB
    out = subprocess.run([str(build_dir() / "alloc_bench"), str(size), str(iters)], env=env,
                         capture_output=True, text=True, check=True).stdout.split()
    return {out[i]: int(out[i + 1]) for i in range(0, len(out), 2)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--standin", action="store_true")
    ap.add_argument("--sizes", default="4K,64K,1M,2M,16M,64M")
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", help="write raw results here")
    a = ap.parse_args()
    sizes = [parse_size(s) for s in a.sizes.split(",")]
    env = dict(os.environ)
    libs: tuple = ()
    if a.standin:
        env["LD_LIBRARY_PATH"] = str(build_dir() / "standin")
        libs = (str(build_dir() / "standin" / "libcuda.so.1"),)
    res: dict = {m: {s: [] for s in sizes} for m in ("bare", "probed")}
    for r in range(a.rounds):
        for mode in ("bare", "probed"):
            tracer = Tracer(libraries=libs, discover=not a.standin, selftest=False).start() if mode == "probed" else None
            try:
                for s in sizes:
                    res[mode][s].append(run_bench(s, a.iters, env))
                    if tracer:
                        tracer.poll()
            finally:
                if tracer:
                    tracer.close()
        print(f"round {r + 1}/{a.rounds} done", file=sys.stderr)
    print(f"{'size':>10} {'alloc bare':>11} {'probed':>8} {'added':>8} {'ratio':>6} | "
          f"{'free bare':>10} {'probed':>8} {'added':>8} {'ratio':>6}   (us, medians)")
    rows = []
    for s in sizes:
        row = {"size": s}
        for op in ("alloc", "free"):
            bare = statistics.median(x[f"{op}_ns"] for x in res["bare"][s]) / 1000
            probed = statistics.median(x[f"{op}_ns"] for x in res["probed"][s]) / 1000
            row[op] = {"bare_us": bare, "probed_us": probed, "added_us": probed - bare, "ratio": probed / bare}
        rows.append(row)
        al, fr = row["alloc"], row["free"]
        print(f"{format_size(s):>10} {al['bare_us']:>11.2f} {al['probed_us']:>8.2f} {al['added_us']:>8.2f} "
              f"{al['ratio']:>6.2f} | {fr['bare_us']:>10.2f} {fr['probed_us']:>8.2f} {fr['added_us']:>8.2f} {fr['ratio']:>6.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"iters": a.iters, "rounds": a.rounds, "standin": a.standin, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
