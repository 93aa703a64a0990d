"""kill -9 torture of `convgpu enforce` (issue 31, part 3): containers of several processes
allocate and free in a loop, with contention for the card (--gpu-memory) and for each limit,
limits given at run time (`convgpu run --limit --name`, `convgpu limit set`), while the
enforcer is killed with SIGKILL again and again and restarted at once:

- at random moments: during its start (before it admits), soon after it admits, or later;
- at fault points (core/faults.py, CONVGPU_FAULT=POINT:N): inside a placement, a grant, a
  resume, a write of the decisions file or of the watchdog's state file, and between a
  decision made durable and its acknowledgement (a point not reached in time: SIGKILL).

After each restart, once it has settled (every allocation made while no enforcer admitted has
been freed: the loops hold for --hold-ms), it is checked that
- every container shows the limit and name it was given at run time (`status`);
- no container holds more than its limit by the driver's own per-process counts (the stand-in's
  shared segment; NVML on a GPU), sampled several times;
- no process is stopped that the enforcer does not list as a waiter (nobody would resume it);
- with the containers frozen (cgroup.freeze) and no call in flight, `status` equals the
  driver's counts, per container.
At the end every job must have finished (exit 0); a job that never started because its
registration was refused (the enforcer died under it) is started again, and counted apart.

    python3 -m bench.torture [--kills 1000] [--json F] [--seed S]   (root; `make` built build/)

Prints jobs lost, over-limit samples while settled, and restart-to-admission per restart
(p50/p99/max). tests/system/test_torture.py runs it with 50+ kills in CI; tests/gpu/
test_gpu_torture.py on real CUDA processes."""
import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict

from bench.torture_parts import (Daemon, Job, Result, Setup, describe, foreign_enforcers, standin_counts, stopped,
                                 stopped_tids, tracer_of, v2_root)

SETTLE_S = 5.0   # s a restarted enforcer's books may take to be within every limit again


class Torture:
    def __init__(self, s: Setup):
        self.s = s
        self.rng = random.Random(s.seed)
        self.r = Result()
        self.run_dir = tempfile.mkdtemp(prefix="convgpu-torture-run-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        self.state_dir = tempfile.mkdtemp(prefix="convgpu-torture-state-")
        self.base = f"/convgpu-torture-{os.getpid()}-{time.monotonic_ns()}"
        os.makedirs(v2_root() + self.base)
        self.jobs: list[Job] = []
        self.n = 0
        self.d: Daemon | None = None
        self.last_kill = ""
        self.foreign_now = False
        self.prev: Daemon | None = None
        self.say = s.log or (lambda line: None)

    # ---- jobs ----
    def _start_job(self):
        self.n += 1
        kind = "set" if self.n % self.s.containers == 0 else "run"
        self.jobs.append(Job(self.s, kind, f"t{self.n}", self.run_dir, self.base))

    def _tend_jobs(self, more: bool):
        """Jobs that ended: done, lost, or refused at registration (started again). Keeps
        `containers` running while `more`; gives pending `limit set`s."""
        for j in list(self.jobs):
            rc = j.p.poll()
            if rc is None:
                continue
            j.out.done.wait(5)
            j.err.done.wait(5)
            self.jobs.remove(j)
            j.remove()
            if rc == 0 and j.started:
                self.r.jobs_done += 1
            elif not j.started and j.kind == "run" and rc == 1:
                self.r.refused += 1          # its registration was refused: it never ran
            else:
                self.r.jobs_lost.append((j.name, f"exit {rc}: {' '.join(j.err.lines[-3:])[:300]}",
                                         "foreign" if self.foreign_now else ""))
        while more and len(self.jobs) < self.s.containers:
            self._start_job()
            self.r.jobs_started += 1
        for j in self.jobs:
            if j.kind == "set" and j.set_state != "given" and self.d and self.d.alive():
                self._limit_set(j)

    def _limit_set(self, j: Job):
        try:
            r = self.d.ctl({"cmd": "limit-set", "container": j.cgroup, "size": j.limit})
        except (OSError, ValueError):
            j.set_state = "unknown"          # it died under the request: kept or not, the next start says
            return
        if r.get("ok"):
            j.set_state = "given"

    # ---- the enforcer ----
    def _restart(self, killed_at: float | None, fault: str | None) -> bool:
        self.prev = self.d
        self.d = Daemon(self.s, self.run_dir, self.state_dir, fault)
        ok = self.d.wait_ready()
        if ok and killed_at is not None:   # a restart (the first start compiles, measures: not one)
            if not any("took over from enforcer" in x for x in self.d.log.lines):
                self.r.fresh += 1
                self.say(f"a restart took over nothing: {[x for x in self.d.log.lines if 'pinned' in x or 'afresh' in x]}")
            self.r.restart_s.append(self.d.ready_at - self.d.t0)
            self.r.unchecked_s.append(self.d.ready_at - killed_at)
        return ok

    def _kill(self, kind: str) -> float:
        """SIGKILL (or reap a self-killed one); returns when it was killed: from then on no
        enforcer admits until the next one is admitting."""
        at = time.monotonic() if self.d.alive() else self._died_at()
        self.d.kill()
        self.r.exit_s.append((round(time.monotonic() - at, 3), kind))   # SIGKILL to reaped
        if self.d.faulted():
            kind = "fault " + self.d.fault.split(":")[0]
        self.r.kills[kind] = self.r.kills.get(kind, 0) + 1
        self.last_kill = kind
        n = sum(self.r.kills.values())
        if n % 50 == 0:
            self.say(f"{n} kills, {self.r.jobs_done} jobs done, {len(self.r.jobs_lost)} lost, "
                     f"{len(self.r.over_limit)} over-limit samples, {time.monotonic() - self.t0:.0f} s")
        return at

    def _died_at(self) -> float:
        """A fault point killed it: when its log ended (its watchdog's line comes after)."""
        return self.d.fault_at or time.monotonic()

    # ---- checks, while settled ----
    def _rows(self, st: dict) -> dict:
        return {c["cgroup"]: c for c in st["containers"]}

    def _check_limits(self, st: dict):
        rows = self._rows(st)
        for j in self.jobs:
            c = rows.get(j.cgroup)
            if c is None or j.p.poll() is not None:
                continue
            got = (c["name"], c["limit"], c["source"])
            if j.set_state == "unknown" and got[2] in ("convgpu limit set", "default"):
                j.set_state = "given" if got[2] == "convgpu limit set" else "pending"
            want = j.expected(self.s)
            if want is not None and got != want:
                self.r.wrong_limits.append((j.name, got, want))

    def _owner(self, pid: int) -> Job | None:
        from convgpu.enforcer.tenants.containers import cgroup_of_pid
        try:
            cg = cgroup_of_pid(pid)
        except Exception:
            return None
        return next((j for j in self.jobs if cg == j.cgroup or cg.startswith(j.cgroup + "/")), None)

    def _sample_over_limit(self):
        per: dict[str, int] = {}
        owners = {}
        counts = self.s.counts()
        for (pid, _dev), n in counts.items():
            j = owners[pid] if pid in owners else owners.setdefault(pid, self._owner(pid))
            if j is not None:
                per[j.name] = per.get(j.name, 0) + n
        self.r.settled_samples += 1
        over = [j for j in self.jobs if per.get(j.name, 0) > j.in_force(self.s) + self.s.over_tolerance]
        if over:
            rows = self._rows(self.d.ctl({"cmd": "status"})["status"])
            for j in over:
                c = rows.get(j.cgroup, {"gpus": {}})
                books = {d: (g["used"] + g["context_overhead"], g["assigned"], g["limit"], g["waiting"], g["contexts"])
                         for d, g in c["gpus"].items()}
                procs = {pid: n for (pid, _d), n in counts.items() if owners.get(pid) is j}
                snap = self.d.ctl({"cmd": "snapshot", "pids": sorted(procs)})["snapshot"]
                seen = {p["pid"]: (p["live"], p["contexts"]) for c2 in snap["containers"] for p in c2["processes"]}
                self.r.over_limit.append((j.name, per[j.name], j.in_force(self.s),
                                          round(time.monotonic() - self.d.ready_at, 3), self.last_kill, books,
                                          {pid: (n, seen.get(pid)) for pid, n in procs.items()},
                                          "foreign" if self.foreign_now else ""))
                if os.environ.get("TORTURE_DEBUG"):
                    for d in (self.prev, self.d):
                        self.say("---- enforcer log:\n" + "\n".join(x for x in (d.log.lines if d else [])
                                                                      if any(str(p) in x for p in procs) or j.name in x))

    def _check_stopped(self):
        """A thread stopped through four looks, 0.15 s apart, whose process no status in
        between lists as waiting: nobody would resume it. One traced by a process that is not
        our enforcer is another's doing (foreign_enforcers)."""
        suspects = None
        known = set()
        for _ in range(4):
            stopped = {(p, t) for j in self.jobs for p in j.pids() for t in stopped_tids(p)}
            st = self.d.ctl({"cmd": "status"})["status"]
            known |= {p for c in st["containers"] for g in c["gpus"].values() for p in g["waiting_pids"]}
            now = {(p, t) for p, t in stopped if p not in known}
            suspects = now if suspects is None else suspects & now
            if not suspects:
                return
            time.sleep(0.15)
        for pid, tid in sorted(suspects):
            tracer = tracer_of(tid)
            if tracer and tracer != self.d.p.pid and not os.path.exists(f"/proc/{self.d.p.pid}/task/{tracer}"):
                self.r.foreign.append(f"pid {pid} thread {tid} held by pid {tracer}")
                continue
            self.r.stopped_unknown.append((pid, tid, describe(pid), round(time.monotonic() - self.d.ready_at, 3),
                                           self.last_kill, st["holds"], "foreign" if self.foreign_now else ""))

    def _check_counts(self):
        """Frozen, no call in flight (nothing reserved, nothing tearing down): status equals the
        driver's counts per container. Five tries, each thawed before the next."""
        bad = []
        for _ in range(5):
            jobs = [j for j in self.jobs if j.p.poll() is None]
            for j in jobs:
                j.freeze(True)
            try:
                deadline = time.monotonic() + 1.0
                while not all(j.frozen() for j in jobs) and time.monotonic() < deadline:
                    time.sleep(0.002)
                st = self.d.ctl({"cmd": "status"})["status"]
                counts = self.s.counts()
                pids = {j.name: set(j.pids()) for j in jobs}
            finally:
                for j in jobs:
                    j.freeze(False)
            rows = self._rows(st)
            bad = []
            for j in jobs:
                driver = sum(n for (pid, _d), n in counts.items() if pid in pids[j.name])
                c = rows.get(j.cgroup)
                gs = c["gpus"].values() if c else ()
                books = sum(g["used"] + g["context_overhead"] for g in gs)
                # a call between its entry and its return: reserved in BPF, maybe done in the
                # driver; an exited process's bytes: the books' until its pidfd fires (tearing)
                low = books - sum(g["tearing_down"] for g in gs) - self.s.tolerance
                high = books + sum(g["reserved"] for g in gs) + self.s.tolerance
                if not low <= driver <= high:
                    bad.append((j.name, books, driver, low, high, ""))
            if not bad:
                self.r.counts_checked += 1
                return
            time.sleep(0.05)
        self.r.counts_mismatch.append((bad, round(time.monotonic() - self.d.ready_at, 3), self.last_kill,
                                       "foreign" if self.foreign_now else ""))

    def _checks(self):
        others = foreign_enforcers({self.d.p.pid, *(x.p.pid for x in (self.prev,) if x)})
        self.foreign_now = bool(others)   # said with each failure of this round
        if others:
            self.r.foreign.extend(others)
        st = self.d.ctl({"cmd": "status"})["status"]
        if st.get("decisions", {}).get("writes"):
            self.r.write_ms.append(st["decisions"]["write_ms"])
        self._check_limits(st)
        if self._settled():
            for _ in range(3):
                self._sample_over_limit()
                time.sleep(0.05)
        self._check_stopped()
        self._check_counts()

    def _settled(self, within: float = SETTLE_S) -> bool:
        """Every container within its limit by the enforcer's own books: what ran unchecked
        while no enforcer admitted has been freed (on a loaded host a loop's 100 ms hold can take
        much longer). Not within `within` s: recorded as a failure (then it admitted too much)."""
        deadline = time.monotonic() + within
        while True:
            rows = self._rows(self.d.ctl({"cmd": "status"})["status"])
            over = [(j.name, held, j.in_force(self.s)) for j in self.jobs if j.cgroup in rows
                    for held in [sum(g["used"] + g["context_overhead"] for g in rows[j.cgroup]["gpus"].values())]
                    if held > j.in_force(self.s) + self.s.over_tolerance]
            if not over:
                return True
            if time.monotonic() > deadline:
                self.r.over_limit.append(("books over the limit", over, round(time.monotonic() - self.d.ready_at, 3),
                                          self.last_kill, "foreign" if self.foreign_now else ""))
                return False
            time.sleep(0.05)

    # ---- the run ----
    def run(self) -> Result:
        t0 = self.t0 = time.monotonic()
        s = self.s
        try:
            if not self._restart(None, None):
                raise RuntimeError(f"the first enforcer died: {self.d.log.lines[-10:]}")
            self._tend_jobs(True)
            killed_at = None
            while sum(self.r.kills.values()) < s.kills:
                if time.monotonic() - t0 > s.deadline_s:
                    raise RuntimeError(f"deadline: {sum(self.r.kills.values())} kills in {s.deadline_s} s")
                x = self.rng.random()
                mode = ("fault" if x < s.fault_share else "start" if x < s.fault_share + s.start_share
                        else "early" if x < s.fault_share + s.start_share + s.early_share else "late")
                fault = f"{self.rng.choice(s.faults)}:{self.rng.randint(1, 3)}" if mode == "fault" else None
                if killed_at is not None:
                    if mode == "start":
                        self.d = Daemon(s, self.run_dir, self.state_dir, None)
                        time.sleep(self.rng.uniform(0.05, 0.9))
                        if not self.d.ready.is_set():
                            killed_at = self._kill("start")
                            continue
                        self.r.restart_s.append(self.d.ready_at - self.d.t0)
                        self.r.unchecked_s.append(self.d.ready_at - killed_at)
                    elif not self._restart(killed_at, fault):   # a fault point in its start
                        killed_at = self._kill("during start")
                        continue
                self._tend_jobs(True)
                if mode == "early":
                    time.sleep(self.rng.uniform(0.0, 0.4))
                    killed_at = self._kill("early")
                    continue
                time.sleep(s.hold_ms / 1000 + 0.3)          # settled: what ran unchecked is freed
                if self.d.alive():
                    try:
                        self._checks()
                        if fault and fault.split(":")[0] in ("save", "ack"):
                            for j in self.jobs:               # a decision to write: the same limit again
                                if j.kind == "set" and j.set_state == "given":
                                    self._limit_set(j)
                                    break
                    except (OSError, ValueError):             # it died under a request (a fault point)
                        pass
                if fault:
                    deadline = time.monotonic() + 1.0
                    while self.d.alive() and time.monotonic() < deadline:
                        time.sleep(0.01)
                    killed_at = self._kill("fault not reached")
                else:
                    time.sleep(self.rng.uniform(0.0, 0.5))
                    killed_at = self._kill("late")
            # the last restart: every job runs to its end under it
            if not self._restart(killed_at, None):
                raise RuntimeError("the last enforcer died")
            end = time.monotonic() + max(120.0, s.rounds * s.hold_ms / 1000 * 8)
            self._tend_jobs(False)
            time.sleep(s.hold_ms / 1000 + 0.3)
            self._checks()
            while self.jobs and time.monotonic() < end:
                self._tend_jobs(False)
                time.sleep(0.2)
            for j in self.jobs:
                for pid in j.pids():
                    if stopped(pid):
                        self.r.left_stopped.append((j.name, pid))
                self.r.jobs_lost.append((j.name, "did not finish"))
        finally:
            self._clean()
            self.r.seconds = time.monotonic() - t0
        return self.r

    def _clean(self):
        for j in self.jobs:
            for pid in [j.p.pid, *j.pids()]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            j.p.wait()
            j.remove()
        if self.d is not None and self.d.alive():
            self.d.p.terminate()
            try:
                self.d.p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.d.kill()
        from convgpu.enforcer.tenants.containers import remove_cgroup
        remove_cgroup(v2_root() + self.base)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        shutil.rmtree(self.state_dir, ignore_errors=True)


def standin_setup(build: str, **kw) -> tuple[Setup, dict]:
    """The stand-in driver: its own shared segment; a context costs --ctx-overhead there too."""
    s = Setup(lib=f"{build}/standin/libcuda.so.1", turns=f"{build}/turns", env={}, counts=None, **kw)
    env = dict(os.environ, LD_LIBRARY_PATH=f"{build}/standin",
               CONVGPU_STANDIN_SHM=f"/convgpu-torture-{os.getpid()}-{time.monotonic_ns()}",
               CONVGPU_STANDIN_CTX_OVERHEAD=str(s.ctx))
    env.pop("CONVGPU_FAULT", None)
    s.env, s.counts = env, standin_counts(f"{build}/standin/standin-usage", env)
    return s, env


def unlink_segment(build: str, env: dict):
    subprocess.run([f"{build}/standin/standin-usage", "--unlink"], env=env, capture_output=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kills", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", help="write the result here")
    ap.add_argument("--build", default=None, help="build dir (default: the package's)")
    a = ap.parse_args()
    from convgpu.paths import build_dir
    from bench.machine import machine
    build = a.build or str(build_dir())
    s, env = standin_setup(build, kills=a.kills, seed=a.seed, deadline_s=48 * 3600,
                           log=lambda line: print(line, file=sys.stderr, flush=True))
    load = [os.getloadavg()]
    try:
        r = Torture(s).run()
    finally:
        unlink_segment(build, env)
    load.append(os.getloadavg())
    out = {"machine": machine(), "standin": True, "loadavg_start_end": load, "nice": os.nice(0), "setup": {k: v for k, v in asdict(s).items()
                                                           if k not in ("env", "counts", "log")},
           "summary": r.summary(), "failures": r.failures(), "restart_s": [round(x, 4) for x in r.restart_s],
           "unchecked_s": [round(x, 4) for x in r.unchecked_s]}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    print(json.dumps(out["summary"], indent=1))
    for line in out["failures"]:
        print("FAIL", line)
    return 1 if out["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
