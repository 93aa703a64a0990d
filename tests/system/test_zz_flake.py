import os, time, sys
sys.path.insert(0, "tests")
from conftest import *
import pytest

def test_states(cgroups, build, caller_env):
    enf = Enforcing(build, "--gpu-memory", "80GiB", "--default-limit", "1GiB")
    cg = cgroups("many")
    procs = []
    try:
        for _ in range(10):
            procs.append(start_in(cg, build, caller_env, "alloc", "-n", 1, "-s", 2 * GiB, "--hold"))
        deadline = time.monotonic() + 20
        def over_limit():
            st = enf.ctl(cmd="status")["status"]
            return next((c["over_limit_events"] for c in st["containers"] if c["name"] == "many"), 0)
        while time.monotonic() < deadline and not (over_limit() == 10 and all(proc_state(p.pid) == "T" for p in procs)):
            time.sleep(0.05)
        seen = {}
        t0 = time.monotonic()
        while time.monotonic() - t0 < 5:
            for p in procs:
                s = proc_state(p.pid)
                if s != "T":
                    seen.setdefault(p.pid, []).append((round(time.monotonic() - t0, 3), s))
            time.sleep(0.001)
        print("non-T:", {k: v[:5] for k, v in seen.items()})
        enf.p.kill()
        rest = enf.p.stderr.read()
        print("\n".join(x for x in (enf.log + rest.splitlines()) if any(str(p.pid) in x for p in procs if p.pid in seen))[-6000:])
    finally:
        for p in procs:
            p.kill(); p.wait()
        enf.p.kill(); enf.p.wait()
