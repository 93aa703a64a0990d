"""Where the enforcer wakes on the GPU host: enforcer running, torch no-caching workload,
per-thread switches/CPU/syscall/wchan sampled every 0.2 s for 12 s."""
import os, sys, time, subprocess, collections
from bench.modes import running
from bench.breakdown import Workload
from convgpu.probes.libs import system_drivers
libcuda = os.path.realpath(system_drivers()[0])
env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1", BREAKDOWN_LIBCUDA=libcuda)
kind = sys.argv[1] if len(sys.argv) > 1 else "torch"
w = Workload(kind, env)
def threads(pid):
    out = {}
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            st = dict(l.split(":", 1) for l in open(f"/proc/{pid}/task/{t}/status"))
            ns = int(open(f"/proc/{pid}/task/{t}/schedstat").read().split()[0])
            sc = open(f"/proc/{pid}/task/{t}/syscall").read().split()[0]
            wc = open(f"/proc/{pid}/task/{t}/wchan").read()
            out[t] = (st["Name"].strip(), int(st["voluntary_ctxt_switches"]), int(st["nonvoluntary_ctxt_switches"]), ns, sc, wc)
        except OSError:
            pass
    return out
for phase in ("idle", "busy"):
  pids = []
  with running("enforced", (libcuda,), False, pids=pids):
    pid = pids[0]
    time.sleep(3)
    w.block(2000)
    a = threads(pid); t0 = time.monotonic()
    seen = collections.defaultdict(collections.Counter)
    if phase == "busy":
        w.p.stdin.write("60000\n"); w.p.stdin.flush()
    for _ in range(40):
        time.sleep(0.2)
        for t, v in threads(pid).items():
            seen[t][(v[4], v[5])] += 1
    b = threads(pid); dt = time.monotonic() - t0
    if phase == "busy":
        print("workload:", w.p.stdout.readline().strip())
    print(f"== {phase} {dt:.1f}s enforcer pid {pid}")
    for t in sorted(b):
        if t in a:
            n, v0, nv0, ns0 = a[t][:4]; _, v1, nv1, ns1 = b[t][:4]
            print(f"{t:>8} {n:20} vol/s {(v1-v0)/dt:8.1f} invol/s {(nv1-nv0)/dt:6.1f} cpu% {100*(ns1-ns0)/dt/1e9:5.1f}  " +
                  "; ".join(f"sys{k[0]}@{k[1]}x{c}" for k, c in seen[t].most_common(3)))
w.close()
