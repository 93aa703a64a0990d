"""Does the work loop's speed flip between regimes, pinned or not? N s each, per-0.5 s medians
and the CPUs each bin ran on."""
import os, statistics as st, sys, time
def work(n):
    x = 0
    for i in range(n):
        x += i * i
def cpu():
    with open("/proc/thread-self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[36])
secs = float(sys.argv[1] if len(sys.argv) > 1 else 25)
for label, cpus in (("unpinned", None), ("pinned-5", {5}), ("pinned-11", {11})):
    try:
        os.sched_setaffinity(0, cpus or set(range(os.cpu_count())))
    except OSError as e:
        print(label, e); continue
    t_end = time.monotonic() + secs
    steps = []
    while time.monotonic() < t_end:
        t0 = time.perf_counter_ns(); work(80000); steps.append((time.monotonic(), time.perf_counter_ns() - t0, cpu()))
    t0 = steps[0][0]; bins = {}
    for t, d, c in steps:
        bins.setdefault(int((t - t0) * 2), []).append((d, c))
    meds = [(st.median(d for d, _ in v) / 1e6, sorted({c for _, c in v})) for k, v in sorted(bins.items())]
    lo = min(m for m, _ in meds)
    print(f"{label}: {len(steps)} steps, median {st.median(d for _, d, _ in steps)/1e6:.2f} ms, min-bin {lo:.2f}, "
          f"bins >1.2x min: {sum(m > 1.2 * lo for m, _ in meds)}/{len(meds)}")
    print("   " + " ".join(f"{m:.1f}@{','.join(map(str, c))}" for m, c in meds[:80]))
