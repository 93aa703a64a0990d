"""What bench.torture checks after each restart of the enforcer, once it has settled (the list:
bench/torture.py's docstring). The checks read the run (a Torture: its setup, its jobs, the
enforcer now running, the kill before it) and add what they find to its Result."""
import os
import time

from bench.torture_parts import Job, describe, foreign_enforcers, stopped_tids, tracer_of

SETTLE_S = 5.0   # s a restarted enforcer's books may take to be within every limit again


class Checks:
    def __init__(self, t):
        self.t = t                                  # the bench.torture.Torture run
        self.s, self.r, self.jobs = t.s, t.r, t.jobs

    @property
    def d(self):
        """The enforcer now running (a new one after each kill)."""
        return self.t.d

    def rows(self, st: dict) -> dict:
        return {c["cgroup"]: c for c in st["containers"]}

    def limits(self, st: dict):
        rows = self.rows(st)
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

    def owner(self, pid: int) -> Job | None:
        from convgpu.enforcer.tenants.containers import cgroup_of_pid
        try:
            cg = cgroup_of_pid(pid)
        except Exception:
            return None
        return next((j for j in self.jobs if cg == j.cgroup or cg.startswith(j.cgroup + "/")), None)

    def over_limit(self):
        per: dict[str, int] = {}
        owners = {}
        counts = self.s.counts()
        for (pid, _dev), n in counts.items():
            j = owners[pid] if pid in owners else owners.setdefault(pid, self.owner(pid))
            if j is not None:
                per[j.name] = per.get(j.name, 0) + n
        self.r.settled_samples += 1
        over = [j for j in self.jobs if per.get(j.name, 0) > j.in_force(self.s) + self.s.over_tolerance]
        if over:
            rows = self.rows(self.d.ctl({"cmd": "status"})["status"])
            for j in over:
                c = rows.get(j.cgroup, {"gpus": {}})
                books = {d: (g["used"] + g["context_overhead"], g["assigned"], g["limit"], g["waiting"], g["contexts"])
                         for d, g in c["gpus"].items()}
                procs = {pid: n for (pid, _d), n in counts.items() if owners.get(pid) is j}
                snap = self.d.ctl({"cmd": "snapshot", "pids": sorted(procs)})["snapshot"]
                seen = {p["pid"]: (p["live"], p["contexts"]) for c2 in snap["containers"] for p in c2["processes"]}
                self.r.over_limit.append((j.name, per[j.name], j.in_force(self.s),
                                          round(time.monotonic() - self.d.ready_at, 3), self.t.last_kill, books,
                                          {pid: (n, seen.get(pid)) for pid, n in procs.items()},
                                          "foreign" if self.t.foreign_now else ""))
                if os.environ.get("TORTURE_DEBUG"):
                    for d in (self.t.prev, self.d):
                        self.t.say("---- enforcer log:\n" + "\n".join(x for x in (d.log.lines if d else [])
                                                                      if any(str(p) in x for p in procs) or j.name in x))

    def unresumed(self):
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
                                           self.t.last_kill, st["holds"], "foreign" if self.t.foreign_now else ""))

    def counts(self):
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
            rows = self.rows(st)
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
        self.r.counts_mismatch.append((bad, round(time.monotonic() - self.d.ready_at, 3), self.t.last_kill,
                                       "foreign" if self.t.foreign_now else ""))

    def __call__(self):
        others = foreign_enforcers({self.d.p.pid, *(x.p.pid for x in (self.t.prev,) if x)})
        self.t.foreign_now = bool(others)   # said with each failure of this round
        if others:
            self.r.foreign.extend(others)
        st = self.d.ctl({"cmd": "status"})["status"]
        if st.get("decisions", {}).get("writes"):
            self.r.write_ms.append(st["decisions"]["write_ms"])
        self.limits(st)
        if self.settled():
            for _ in range(3):
                self.over_limit()
                time.sleep(0.05)
        self.unresumed()
        self.counts()

    def settled(self, within: float = SETTLE_S) -> bool:
        """Every container within its limit by the enforcer's own books: what ran unchecked
        while no enforcer admitted has been freed (on a loaded host a loop's 100 ms hold can take
        much longer). Not within `within` s: recorded as a failure (then it admitted too much)."""
        deadline = time.monotonic() + within
        while True:
            rows = self.rows(self.d.ctl({"cmd": "status"})["status"])
            over = [(j.name, held, j.in_force(self.s)) for j in self.jobs if j.cgroup in rows
                    for held in [sum(g["used"] + g["context_overhead"] for g in rows[j.cgroup]["gpus"].values())]
                    if held > j.in_force(self.s) + self.s.over_tolerance]
            if not over:
                return True
            if time.monotonic() > deadline:
                self.r.over_limit.append(("books over the limit", over, round(time.monotonic() - self.d.ready_at, 3),
                                          self.t.last_kill, "foreign" if self.t.foreign_now else ""))
                return False
            time.sleep(0.05)
