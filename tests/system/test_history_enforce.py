"""Issue 42 on the stand-in: `convgpu run` jobs under an in-process enforcer (real probes, real
cgroups) are kept in the job history, and `convgpu recommend` gives exactly what
docs/RECOMMEND.md's method says. Three runs of `hist` (run at once, to keep the test short)
peak at 300, 400 and 500 MiB of allocations plus one context each (charged 64 MiB): the
largest, 564 MiB, plus 10 % is 620.4 MiB, rounded up to 256 MiB: 768 MiB; it asked 2 GiB, so
it asks over twice what it needs. `tight` asks 256 MiB and is stopped at a 300 MiB call above
it (its demand: 364 MiB): under-asking, recommended 512 MiB (364 + 36.4, rounded up)."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

from conftest import GiB, MiB, inprocess_enforcer, read_until, serving, until

pytestmark = pytest.mark.system
CTX = 64 * MiB


def test_three_runs_give_the_documented_recommendation(root, build, caller_env):
    from convgpu.cli.main import app
    from convgpu.enforcer.history.store import HistoryFile
    env = dict(caller_env, CONVGPU_STANDIN_CAPACITY=str(16 * GiB),
               CONVGPU_STANDIN_SHM=f"/convgpu-hist-{os.getpid()}-{time.monotonic_ns()}")
    enf = inprocess_enforcer(build / "standin" / "libcuda.so.1", "hist", GiB, capacity={0: 8 * GiB}, ctx_overhead=CTX)
    state = enf.durable.dir
    procs = []

    def run(name, limit, n, size):
        p = subprocess.Popen([sys.executable, "-m", "convgpu.cli.main", "run", "--limit", limit, "--name", name,
                              "--run-dir", enf.run_dir, "--", str(build / "cgcaller"), "alloc", "-n", str(n),
                              "-s", str(size), "--hold"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
        procs.append(p)
        return p

    def live(job):
        return sorted(lv.gpus.get(0, [0])[0] for lv in list(enf.history.live.values()) if lv.job.key == job)

    try:
        with serving(enf):
            hist = [run("hist", "2GiB", n, size) for n, size in ((3, 100 * MiB), (2, 200 * MiB), (1, 500 * MiB))]
            tight = run("tight", "256MiB", 1, 300 * MiB)
            for p in hist:
                read_until(p, "ready")
            # sampled once a second: each run seen at its peak, and tight stopped above its limit: its
            # peak is its context, what it held, never the 300 MiB it was stopped asking for (issue 52)
            until(lambda: live("run:hist") == [364 * MiB, 464 * MiB, 564 * MiB] and live("run:tight") == [64 * MiB],
                  10, "the recorder never saw the runs at their peaks")
            waiter = next(iter(next(b for b in list(enf.books.boxes.values()) if b.name == "tight").pids))
            for p in hist:
                p.stdin.write("\n")
                p.stdin.flush()
            os.kill(waiter, signal.SIGKILL)
            for p in procs:
                p.communicate(timeout=30)
            assert [p.returncode for p in hist] == [0, 0, 0] and tight.returncode == 128 + signal.SIGKILL
            until(lambda: not enf.history.live, 10, "the runs never ended")
        # closed: what was pending is written
        h = HistoryFile(state).read()
        assert sorted(h.jobs) == ["run:hist", "run:tight"]
        assert sorted(r.peak for r in h.jobs["run:hist"]) == [364 * MiB, 464 * MiB, 564 * MiB]
        assert sorted((r.gpus[0].used, r.gpus[0].ctx, r.gpus[0].contexts) for r in h.jobs["run:hist"]) == \
            [(300 * MiB, CTX, 1), (400 * MiB, CTX, 1), (500 * MiB, CTX, 1)]
        assert sorted(r.allocs for r in h.jobs["run:hist"]) == [1, 2, 3]
        r = CliRunner().invoke(app, ["recommend", "--state-dir", state, "--json"])
        assert r.exit_code == 0, r.output
        got = {j["job"]: j for j in json.loads(r.output)["jobs"]}
        want = {"run:hist": dict(runs=3, peak=564 * MiB, peaks={"0": 564 * MiB}, limit=768 * MiB, covers=3,
                                 asked=2 * GiB, units=3, over_asking=True, under_asking=False, over_limits=0),
                "run:tight": dict(runs=1, peak=64 * MiB, peaks={"0": 64 * MiB}, limit=256 * MiB, covers=1,
                                  asked=256 * MiB, units=1, over_asking=False, under_asking=True, over_limits=1)}
        assert {j: {k: got[j][k] for k in w} for j, w in want.items()} == want
        assert got["run:hist"]["forms"]["run"] == "convgpu run --limit 768MiB --name hist -- COMMAND"
        assert got["run:tight"]["stalls"] == 1 and got["run:hist"]["stalls"] == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
