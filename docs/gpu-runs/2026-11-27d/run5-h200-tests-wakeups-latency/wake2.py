"""The enforcer's threads' wake-ups with a running CUDA workload (held block, pinned), after
its placement; and what the holder has seized (status), sampled over 8 s."""
import glob, json, os, subprocess, sys, time
from bench.modes import running
from convgpu.probes.libs import system_drivers
lib = os.path.realpath(system_drivers()[0])
def threads(pid):
    out = {}
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            st = dict(l.split(":", 1) for l in open(f"/proc/{pid}/task/{t}/status"))
            ns = int(open(f"/proc/{pid}/task/{t}/schedstat").read().split()[0])
            out[t] = (st["Name"].strip(), int(st["voluntary_ctxt_switches"]), ns)
        except OSError:
            pass
    return out
pids = []
with running("enforced", (lib,), False, pids=pids):
    enf = pids[0]
    w = subprocess.Popen([sys.executable, "-m", "bench.e2e_workloads", "standin", "--lib", lib, "--hold", "1",
                          "--allocs", "10", "--work", "40000", "--pin", "5"], stdout=subprocess.PIPE, text=True)
    print(w.stdout.readline().strip())
    run_dir = max(glob.glob("/tmp/convgpu-bench-*"), key=os.path.getmtime)
    for phase in range(3):
        time.sleep(1.0)
        st = json.loads(subprocess.run([sys.executable, "-m", "convgpu.cli.main", "status", "--json", "--run-dir", run_dir],
                                       capture_output=True, text=True).stdout or "{}")
        a = threads(enf); t0 = time.monotonic(); time.sleep(4); b = threads(enf); dt = time.monotonic() - t0
        print(f"== phase {phase}: seized {st.get('holds', {}).get('seized')} workload {w.pid}")
        for t in sorted(b):
            if t in a:
                print(f"{t:>8} {b[t][0]:20} vol/s {(b[t][1]-a[t][1])/dt:8.1f} cpu% {100*(b[t][2]-a[t][2])/dt/1e9:5.1f}")
    w.kill()
