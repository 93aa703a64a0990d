"""The scheduling workload with real processes under `convgpu enforce`, next to the simulator.

    .venv/bin/python -m bench.sched.real [--n 6] [--seed 0] [--scale 0.05] [--overhead paper]

Each container is a cgroup of its own (cgroup2) holding one `cgcaller alloc -n 1 -s SIZE --hold`
on the stand-in driver (or --lib): it creates its context, allocates its size once, and is
told to free and exit `duration x scale` seconds after its allocation succeeded. Arrivals come
every `5 s x scale`. The enforcer runs with --gpu-memory 5GiB, --ctx-overhead, one --limit per
container (size + overhead), the policy, --seed and --max-wait x scale. The stand-in driver
gets the same 5 GiB and overhead, so an allocation that passed the enforcer's assignment would
fail there and its own peak shows whether the GPU was ever over-committed.

Times are reported unscaled (divided by --scale) to compare with the simulator on the same
seed. A run that stops making progress (everyone left is stopped) is reported as a deadlock.
Needs root and bcc. Run with CONVGPU_BUILD pointing at a private build when others share the
machine (the enforcer is started with --no-discover --lib, so it sees only that driver).

    .venv/bin/python -m bench.sched.real --deadlocked-before

runs every policy on DEADLOCKED_BEFORE: a workload on which ru and rand deadlocked (in the
simulator and for real) before every grant and placement passed the banker's check, and which
every policy now finishes (issue 14, part 4)."""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from convgpu.enforcer import policies
from convgpu.enforcer.tenants.containers import cgroup_layout, remove_cgroup
from convgpu.paths import build_dir
from convgpu.units import parse_size

from .sim import simulate
from .workload import CAPACITY, OVERHEADS, Job, generate

MiB = 1 << 20
# 4 containers (1 GiB for 44 s, 512 MiB for 41 s, then two of 4 GiB) with the H100's 519 MiB
# contexts: before the check, ru and rand handed the 1.5 GiB of the first exit to the newest
# 4 GiB container, which made its context beside the other's; with two contexts held, 4082 MiB
# was the most either could get and each needs 4096: both stopped for good. Now that grant is
# not safe, the older one gets it (docs/SCHEDULING.md, "Real runs").
DEADLOCKED_BEFORE = {"n": 4, "seed": 88, "overhead": "h100"}
RESUME = re.compile(r"resume (\S+) on GPU\d+ after ([0-9.]+) s")


@dataclass
class Proc:
    job: Job
    start: float | None = None     # monotonic s
    ready: float | None = None
    end: float | None = None
    error: str = ""
    p: subprocess.Popen | None = None


@dataclass
class EnforcerLog:
    lines: list[tuple[float, str]] = field(default_factory=list)
    started: threading.Event = field(default_factory=threading.Event)

    def read(self, stream):
        for line in stream:
            self.lines.append((time.monotonic(), line.rstrip()))
            if "enforcing:" in line:
                self.started.set()
        self.started.set()   # EOF: it ended (the caller checks why)


def stand_in_peak(lib: Path, env: dict) -> int | None:
    """The stand-in's own peak of device memory in use (None on a real driver)."""
    tool = lib.parent / "standin-usage"
    if not tool.exists():
        return None
    r = subprocess.run([str(tool), "--json"], env=env, capture_output=True, text=True)
    return json.loads(r.stdout)["devices"][0]["peak"] if r.returncode == 0 else None


def unlink_stand_in(lib: Path, env: dict):
    tool = lib.parent / "standin-usage"
    if tool.exists():
        subprocess.run([str(tool), "--unlink"], env=env, capture_output=True)


def stand_in_env(shm: str, overhead: int, lib: Path) -> dict:
    return dict(os.environ, LD_LIBRARY_PATH=str(lib.parent), CONVGPU_STANDIN_SHM=shm,
                CONVGPU_STANDIN_CAPACITY=str(CAPACITY), CONVGPU_STANDIN_CTX_OVERHEAD=str(overhead))


@contextmanager
def enforcer(lib: Path, limits: dict[str, int], *args: str, capacity: int = CAPACITY, tag: str = "sched",
             debug: bool = False):
    """`convgpu enforce` on `lib` only (--no-discover), one --limit per container, a run dir of
    its own; yields (process, log). Stopped (a clean exit resumes whatever it holds) at the end.
    debug: its debug lines too (the exit path's timeline)."""
    # on tmpfs like /run on a systemd host: the enforcer rewrites its state file (write + rename)
    # after every decision, and on a disk file system (this VM's /tmp and /run are ext4) a rename
    # over a fresh file can wait for writeback and hold its loop for hundreds of ms
    run_dir = tempfile.mkdtemp(prefix=f"{tag}-run-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    argv = [sys.executable, "-m", "convgpu.cli.main", *(["--debug"] if debug else []), "enforce", "--no-discover", "--lib", str(lib),
            "--run-dir", run_dir, "--state-dir", run_dir, "--gpu-memory", f"{capacity}B", *args]   # never the host's state
    for name, size in limits.items():
        argv += ["--limit", f"{name}={size}B"]
    p = subprocess.Popen(argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    log = EnforcerLog()
    threading.Thread(target=log.read, args=(p.stderr,), daemon=True).start()
    try:
        if not log.started.wait(60) or p.poll() is not None:
            raise RuntimeError(f"enforcer did not start: {[x for _, x in log.lines[-10:]]}")
        yield p, log
    finally:
        p.terminate()
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        shutil.rmtree(run_dir, ignore_errors=True)


@contextmanager
def cgroup_dirs(base_name: str, names):
    """Fresh cgroup2 directories <v2 root>/<base_name>/<name>, removed once empty at the end."""
    lay = cgroup_layout()
    if lay.v2_root is None:
        raise RuntimeError("no cgroup2 hierarchy")
    base = Path(lay.v2_root) / base_name
    cgs = {n: base / n for n in names}
    try:
        for d in cgs.values():
            d.mkdir(parents=True, exist_ok=True)
        yield cgs
    finally:
        for d in list(cgs.values()) + [base]:
            remove_cgroup(d)


def in_cgroup(cg: Path, *argv: str) -> list[str]:
    """argv, started inside cgroup `cg` (it joins before exec: its first CUDA call is there)."""
    return ["/bin/sh", "-c", f'echo $$ > {cg}/cgroup.procs && exec "$0" "$@"', *argv]


def proc_state(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def run_container(proc: Proc, cg: Path, env: dict, t0: float, scale: float, cgcaller: Path):
    """One container's life, on its own thread: arrive, wait for its allocation, run, exit."""
    j = proc.job
    time.sleep(max(0.0, t0 + j.arrival * scale - time.monotonic()))
    proc.start = time.monotonic()
    proc.p = subprocess.Popen(in_cgroup(cg, str(cgcaller), "alloc", "-n", "1", "-s", str(j.size), "--hold"),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env)
    for line in proc.p.stdout:
        if line.startswith("allocated"):
            if f"allocated 1 {j.size}" not in line:
                proc.error = line.strip()
        elif line.startswith("ready"):
            proc.ready = time.monotonic()
            break
    else:
        proc.error = proc.error or f"ended before ready: {proc.p.stderr.read().strip()}"
        return
    time.sleep(j.duration * scale)
    proc.p.stdin.write("\n")
    proc.p.stdin.flush()
    proc.p.wait()
    proc.end = time.monotonic()
    if proc.p.returncode != 0:
        proc.error = f"exit {proc.p.returncode}: {proc.p.stderr.read().strip()}"


def stalled_all(procs: list[Proc]) -> bool:
    """Every container still alive is stopped (state T, or t: a thread held alone under
    ptrace, issue 23) and has been started: no progress can come from them, and nobody else
    will free memory."""
    alive = [x for x in procs if x.end is None and not x.error]
    if not alive or any(x.p is None for x in alive):
        return False
    return all(proc_state(x.p.pid) in ("T", "t") for x in alive)


def run_policy(policy: str, jobs: list[Job], overhead: int, seed: int, scale: float,
               max_wait: float, lib: Path, cgcaller: Path, tag: str) -> dict:
    """One real run; returns times in unscaled seconds and what the enforcer said."""
    env = stand_in_env(f"/{tag}-{os.getpid()}-{policy}", overhead, lib)
    procs = [Proc(j) for j in jobs]
    deadlock = False
    limits = {j.name: j.size + overhead for j in jobs}
    with cgroup_dirs(f"{tag}-{os.getpid()}-{policy}", limits) as cgs, \
            enforcer(lib, limits, "--ctx-overhead", f"{overhead}B", "--policy", policy, "--seed", str(seed),
                     "--max-wait", repr(max_wait * scale), tag=tag) as (_, log):
        try:
            t0 = time.monotonic() + 0.2
            threads = [threading.Thread(target=run_container, daemon=True,
                                        args=(x, cgs[x.job.name], env, t0, scale, cgcaller)) for x in procs]
            for t in threads:
                t.start()
            stuck_since = None
            while any(t.is_alive() for t in threads):
                time.sleep(0.05)
                if stalled_all(procs) and all(x.start for x in procs):
                    stuck_since = stuck_since or time.monotonic()
                    # nothing left to arrive, nothing moved for 2 s (8 heartbeats): a deadlock
                    if time.monotonic() - stuck_since > 2.0:
                        deadlock = True
                        break
                else:
                    stuck_since = None
        finally:
            for x in procs:   # deadlocked (stopped) ones: killed before the enforcer's clean exit
                if x.p and x.p.poll() is None:   # would resume them into the stand-in's OOM
                    x.p.kill()
                    x.p.wait()
            peak = stand_in_peak(lib, env)
            unlink_stand_in(lib, env)
    stalled: dict[str, float] = {}
    for _, line in log.lines:
        m = RESUME.search(line)
        if m and "enforcer stopping" not in line:
            stalled[m.group(1)] = stalled.get(m.group(1), 0.0) + float(m.group(2))
    rows = []
    for x in procs:
        if deadlock and x.ready is None:
            x.error = ""   # killed by us while stopped: the deadlock, not an error
        rows.append({"name": x.job.name, "size": x.job.size, "error": x.error,
                     "ready": (x.ready - t0) / scale if x.ready else None,
                     "end": (x.end - t0) / scale if x.end else None,
                     # the enforcer's own measure (placement stop included), unscaled
                     "suspended": stalled.get(x.job.name, 0.0) / scale,
                     # the harness's: start to allocation done, process start-up included
                     "waited": (x.ready - x.start) / scale if x.ready else None})
    ends = [r["end"] for r in rows]
    done = all(e is not None for e in ends)
    return {"policy": policy, "deadlock": deadlock, "peak": peak,
            "makespan": max(ends) - jobs[0].arrival if done else None,
            "mean_suspended": sum(r["suspended"] for r in rows) / len(rows),
            "errors": [r["error"] for r in rows if r["error"]], "jobs": rows,
            "log": [line for _, line in log.lines if "daemon: " in line][-400:]}


def compare(policy: str, jobs: list[Job], overhead: int, seed: int, max_wait: float, real: dict) -> dict:
    """The simulator on the same jobs next to a real run. A deadlocked run has no makespan and
    no meaningful mean (its stuck containers never resumed): both None."""
    s = simulate(jobs, policy, overhead, seed=seed, max_wait=max_wait)
    sim = {"makespan": None if s.deadlocked else s.makespan, "deadlock": bool(s.deadlocked),
           "mean_suspended": None if s.deadlocked else s.mean_suspended,
           "ready": {o.name: o.ready for o in s.jobs}}
    r = {k: real[k] for k in ("makespan", "deadlock", "mean_suspended", "peak", "errors")}
    if real["deadlock"]:
        r["mean_suspended"] = None
    r["ready"] = {x["name"]: x["ready"] for x in real["jobs"]}
    # how far each container's start (its allocation done) is from the simulator's
    diffs = [abs(r["ready"][k] - v) for k, v in sim["ready"].items()
             if v is not None and r["ready"].get(k) is not None]
    return {"policy": policy, "sim": sim, "real": r,
            "same_outcome": [v is None for v in sim["ready"].values()] == [v is None for v in r["ready"].values()],
            "max_ready_diff": max(diffs) if diffs else None, "jobs": real["jobs"], "log": real["log"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scale", type=float, default=0.05, help="real seconds per workload second")
    ap.add_argument("--overhead", default="paper", help="paper (66 MiB), h100 (519 MiB) or a size")
    ap.add_argument("--policies", default="fifo,bf,ru,rand,bfa")
    ap.add_argument("--max-wait", type=float, default=policies.MAX_WAIT, help="bfa, unscaled s")
    ap.add_argument("--lib", default=None, help="libcuda.so.1 (default: the build's stand-in)")
    ap.add_argument("--out", default="docs/img/sched")
    ap.add_argument("--tag", default="sched-real", help="prefix of cgroups, shm and run dirs")
    ap.add_argument("--deadlocked-before", action="store_true",
                    help=f"--n, --seed and --overhead of DEADLOCKED_BEFORE {DEADLOCKED_BEFORE}")
    a = ap.parse_args(argv)
    if a.deadlocked_before:
        a.n, a.seed, a.overhead = (DEADLOCKED_BEFORE[k] for k in ("n", "seed", "overhead"))
    overhead = OVERHEADS[a.overhead] if a.overhead in OVERHEADS else parse_size(a.overhead, "--overhead")
    lib = Path(a.lib) if a.lib else build_dir() / "standin" / "libcuda.so.1"
    jobs = generate(a.n, a.seed)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for policy in a.policies.split(","):
        real = run_policy(policy, jobs, overhead, a.seed, a.scale, a.max_wait, lib,
                          build_dir() / "cgcaller", a.tag)
        c = compare(policy, jobs, overhead, a.seed, a.max_wait, real)
        results.append(c)
        s, r = c["sim"], c["real"]
        print(f"{policy:5} makespan sim {fmt(s['makespan'])} real {fmt(r['makespan'])} | mean suspended "
              f"sim {fmt(s['mean_suspended'])} real {fmt(r['mean_suspended'])} | starts differ by <= "
              f"{fmt(c['max_ready_diff'])} s | deadlock sim {s['deadlock']} real {r['deadlock']} | "
              f"peak {r['peak'] and r['peak'] // MiB} MiB{' | errors ' + str(r['errors']) if r['errors'] else ''}",
              flush=True)
    meta = {"n": a.n, "seed": a.seed, "scale": a.scale, "overhead": overhead, "max_wait": a.max_wait,
            "jobs": [asdict(j) for j in jobs], "date": time.strftime("%Y-%m-%d"),
            "command": "python -m bench.sched.real " + " ".join(argv if argv is not None else sys.argv[1:])}
    name = f"real-n{a.n}-seed{a.seed}-{a.overhead}"
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print(f"wrote {out / (name + '.json')}", file=sys.stderr)
    return 0


def fmt(x) -> str:
    return "  dead" if x is None else f"{x:6.1f}"


if __name__ == "__main__":
    sys.exit(main())
