"""Wall vs thread CPU time of the same work step, and the host's steal, per 0.5 s bin."""
import os, statistics as st, sys, time
def work(n):
    x = 0
    for i in range(n):
        x += i * i
def steal():
    with open("/proc/stat") as f:
        return {l.split()[0]: int(l.split()[8]) for l in f if l.startswith("cpu")}
secs = float(sys.argv[1] if len(sys.argv) > 1 else 25)
CPU = int(os.environ.get("PIN", "5")); os.sched_setaffinity(0, {CPU})
t_end = time.monotonic() + secs
bins, cur, s0, tb = [], [], steal(), time.monotonic() + 0.5
while time.monotonic() < t_end:
    w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
    work(40000)
    cur.append((time.perf_counter_ns() - w0, time.thread_time_ns() - c0))
    if time.monotonic() >= tb:
        s1 = steal()
        bins.append((st.median(w for w, _ in cur) / 1e6, st.median(c for _, c in cur) / 1e6, (s1[f"cpu{CPU}"] - s0[f"cpu{CPU}"])))
        cur, s0, tb = [], s1, tb + 0.5
wl = min(b[0] for b in bins); cl = min(b[1] for b in bins)
print(f"wall bins >1.2x min: {sum(b[0] > 1.2 * wl for b in bins)}/{len(bins)}; cpu bins >1.2x min: {sum(b[1] > 1.2 * cl for b in bins)}/{len(bins)}; steal ticks total {sum(b[2] for b in bins)}")
print("wall/cpu/steal: " + " ".join(f"{w:.1f}/{c:.1f}/{s}" for w, c, s in bins))
