"""kill -9 torture of `convgpu enforce` (issue 31, part 3): containers of several processes
allocate and free in a loop, with contention for the card (--gpu-memory) and for each limit,
limits given at run time (`convgpu run --limit --name`, `convgpu limit set`), while the
enforcer is killed with SIGKILL again and again and restarted at once:

- at random moments: during its start (before it admits), soon after it admits, or later;
- at fault points (core/faults.py, CONVGPU_FAULT=POINT:N): inside a placement, a grant, a
  resume, a write of the decisions file or of the watchdog's state file, and between a
  decision made durable and its acknowledgement (a point not reached in time: SIGKILL).

After each restart, once it has settled (every allocation made while no enforcer admitted has
been freed: the loops hold for --hold-ms), it is checked (bench/torture_checks.py) that
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

from bench.torture_checks import Checks
from bench.torture_parts import Daemon, Job, Result, Setup, standin_counts, stopped, v2_root


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
        self.checks = Checks(self)

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
                        self.checks()
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
            self.checks()
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
        if self.jobs and os.environ.get("CONVGPU_TORTURE_DUMP"):
            self._dump(os.environ["CONVGPU_TORTURE_DUMP"])
        for j in self.jobs:
            for pid in [j.p.pid, *j.pids()]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            j.p.wait()
            j.remove()
        if self.d is not None and self.d.alive():
            self.d.p.send_signal(signal.SIGINT)   # a release at once, --handover or not
            try:
                self.d.p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.d.kill()
        from convgpu.enforcer.tenants.containers import remove_cgroup
        remove_cgroup(v2_root() + self.base)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        shutil.rmtree(self.state_dir, ignore_errors=True)

    def _dump(self, path: str):
        """Jobs that never finished: what the enforcer said of them (status and its log) and
        each of their threads' state, for a run where nobody can watch (the GPU machine)."""
        out = [f"jobs left: {[j.name for j in self.jobs]}"]
        try:
            out.append(json.dumps(self.d.ctl({"cmd": "status"})["status"], indent=1, default=str))
        except Exception as e:     # a dump says what it could not get, and goes on
            out.append(f"status: {e!r}")
        for j in self.jobs:
            for pid in j.pids():
                try:
                    tids = sorted(os.listdir(f"/proc/{pid}/task"), key=int)
                except OSError:   # gone meanwhile
                    tids = []
                for tid in tids:
                    try:
                        state = open(f"/proc/{pid}/task/{tid}/stat").read().rsplit(")", 1)[1].split()[0]
                        wchan = open(f"/proc/{pid}/task/{tid}/wchan").read()
                        lines = [x.strip() for x in open(f"/proc/{pid}/task/{tid}/status")
                                 if x.startswith(("TracerPid", "SigPnd", "ShdPnd", "SigBlk"))]
                        out.append(f"{j.name} pid {pid} tid {tid} state {state} wchan {wchan} {' '.join(lines)}")
                    except OSError as e:
                        out.append(f"{j.name} pid {pid} tid {tid}: {e}")
        for d, name in ((self.prev, "previous"), (self.d, "last")):
            out.append(f"---- the {name} enforcer's log\n" + "\n".join(d.log.lines[-500:] if d else []))
        with open(path, "w") as f:
            f.write("\n".join(out) + "\n")


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
