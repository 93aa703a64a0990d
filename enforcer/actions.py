"""Actions out: the BPF maps the probes read (control, assign, cgstate), and resuming or
thawing who waited. The only module of the enforcer that writes the maps."""
import contextlib
import ctypes as ct
import logging
import os
import signal
import time

from ..faults import FAULT
from ..probes.discovery import HELD_OPEN
from .books import Box
from .failsafe.stall import SignalStopper, Target

log = logging.getLogger(__package__ + ".daemon")   # the Enforcer logs as one: "daemon: ..." (bench/sched, tests read it)
VIEW_GRACE = 10.0        # s after a view's last snapshot: alloc/free events flow (else quiet)


class Actions:
    """Part of Enforcer (enforcer/daemon.py): writes to BPF's maps, resumes and thaws."""

    def _t(self, name):
        return self.tracer.b[name.encode()]

    def _control(self, enforcing: bool) -> int:
        """Writes the control map; returns the waiters count BPF knew before."""
        told, self._told = self._told, sum(len(b.waiting) for b in self.boxes.values())
        # a context call of a process not placed yet reserves this (placed: its device's estimate);
        # not a GPU's whose context is being measured: its newcomers wait, and are placed asking
        # for the figure measured (overhead.py _release_held), and its stand-in figure until then
        # is the conservative one, which would hold a small container's first context for good
        self._leaf = dict(ctx_overhead=max((e.bytes for d, e in self.est.items() if d not in self._measure_wait),
                                           default=0),
                          enforcing=int(enforcing), exempt=self._exempt,
                          over_limit_kill=int(self.over_limit == "kill"), waiters=self._told,
                          owner=self.owner, quiet=int(enforcing and self._quiet()), **self.quota.leaf())
        self._write_control()
        return told

    def _write_control(self):
        """The latest fields with a fresh heartbeat: read under the lock, so the heartbeat
        thread never writes back fields older than the loop's last write."""
        with self._control_lock:
            t = self._t("control")
            t[ct.c_int(0)] = t.Leaf(heartbeat_ns=time.monotonic_ns(), measuring=self._measuring, **self._leaf)

    def _quiet(self) -> bool:
        return time.monotonic() - self._viewed > VIEW_GRACE

    def write_assign(self, box: Box, dev: int):
        t = self._t("assign")
        nbytes, nctx = box.adopted.get(dev, (0, 0))
        t[t.Key(container=box.key, dev=dev)] = t.Leaf(limit=self.books.limit(box, dev), assigned=box.assigned[dev],
                                                      extra_overhead=box.extra.get(dev, 0),
                                                      adopted=nbytes, adopted_contexts=nctx,
                                                      ctx_charge=self._ctx(dev), torn=box.torn.get(dev, 0))

    def _state(self, box: Box, dev: int):
        t = self._t("cgstate")
        try:
            return t[t.Key(container=box.key, dev=dev)]
        except KeyError:
            return None

    def _ensure_state(self, box: Box, dev: int):
        """BPF charges a container's bytes on a device once this entry exists (never reset:
        a shim process may have been charged before the device was assigned)."""
        st = self._t("cgstate")
        k = st.Key(container=box.key, dev=dev)
        try:
            st[k]
        except KeyError:
            st[k] = st.Leaf()

    @contextlib.contextmanager
    def _exempting(self, pid: int):
        """BPF does not admit pid meanwhile: a self-test child that calls every symbol of a
        library just attached (it would stall). Everyone else stays checked: turning admission
        off instead let any process allocate unchecked while the child ran. Admission itself
        stays as it was (off during start-up, until the watchdog runs)."""
        enforcing = bool(self._leaf.get("enforcing"))
        self._exempt = pid
        self._control(enforcing)
        try:
            yield
        finally:
            self._exempt = 0
            self._control(enforcing)

    def resume_asks(self, box: Box, dev: int, asks, why: str):
        """Some of the container's stopped calls may run (each fits: decisions._serve); the
        others go on waiting. The whole wait, when they were all."""
        w = box.waiting.get(dev)
        if w is None:
            return
        if {a.tid for a in asks} >= set(w.asks) and not w.wakes:
            return self.resume(box, dev, why)
        for a in asks:
            w.asks.pop(a.tid, None)
            self._send_on(box, dev, a)
        w.pids = {a.pid for a in w.asks.values()} | {p for p, _, _ in w.wakes}
        self.decider.stuck.discard(dev)
        now = time.monotonic()
        log.info("resume %s on GPU%d after %.3f s (%s): %s; %d still waiting", box.name, dev,
                 now - min(a.since for a in asks), why,
                 ", ".join(f"pid {a.pid} thread {a.tid}" for a in asks), len(w.asks))

    def _send_on(self, box: Box, dev: int, a):
        """Let a granted call run. Its room is taken until its recheck reserves it in BPF
        (books._taken): a resumed thread may need milliseconds to get there on a loaded host,
        and a grant decided meanwhile must not count on the same room. Before, a whole wait
        resumed was not counted so: three contexts resumed together, a fourth placed a
        millisecond later was granted beside them, and one of the four met its recheck over
        the assignment (issue 23: a restall that then held a sibling thread for good)."""
        if self.holder is not None:   # dropped once BPF's `held` forgets the stop (decisions._gone_through)
            box.going.setdefault(dev, {})[a.tid] = a
        self._let_go(a.pid, a.tid, a.seq)
        if FAULT:
            FAULT.hit("resume")   # this call let go, the wait's others (if any) not yet

    def _let_go(self, pid: int, tid: int, seq: int):
        if self.holder is not None:
            self.holder.release(pid, tid, seq)   # the thread alone, or SIGCONT where held whole
        else:
            self.stopper.resume(Target((pid,)))

    def resume(self, box: Box, dev: int, why: str):
        w = box.waiting.pop(dev, None)
        if w is None:
            return
        box.stalled_s += time.monotonic() - w.since
        self.decider.stuck.discard(dev)
        self.broker.granted(box, dev, w.wakes, {"grant": True})
        if isinstance(self.stopper, SignalStopper):
            for a in w.asks.values():
                self._send_on(box, dev, a)
            rest = w.pids - self.shimmed - {a.pid for a in w.asks.values()}
            if rest:
                self.stopper.resume(Target(tuple(rest)))
        elif box.waiting:   # freezer: thawed, its process on another GPU would meet no grant
            log.info("resume %s on GPU%d after %.3f s (%s); it stays frozen until GPU%s %s",
                     box.name, dev, time.monotonic() - w.since, why,
                     ", GPU".join(map(str, sorted(box.waiting))), "settles" if len(box.waiting) == 1 else "settle")
            return
        else:
            self._thaw(box)
        log.debug("resumed %s pids %s (t=%d)", box.name, sorted(w.pids), time.monotonic_ns())
        log.info("resume %s on GPU%d after %.3f s (%s)", box.name, dev, time.monotonic() - w.since, why)

    def _resume_unplaced(self) -> set[int]:
        """At a stop, after admission went off: SIGCONT every process BPF stopped at a call that
        the loop never heard of (stopped, then SIGTERM before the next pass: nobody placed it,
        so no waiter resumes it). BPF lists each such thread in `held` with no HELD_OPEN bit
        (an open held by discovery is the tracer's to resume); passing its recheck drops it."""
        time.sleep(0.02)   # a program past its check when admission went off may still stop one
        pids = {k.value >> 32 for k, v in self._t("held").items() if not v.value & HELD_OPEN}
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGCONT)
        if pids:
            log.info("stopping: resumed %d processes stopped before they were placed", len(pids))
        return pids

    def _thaw(self, box: Box):
        """Freezer: the container runs again, and no process of it stays signal-stopped. Only
        once none of its devices waits: a container frozen on two GPUs has both grants settled
        first (schedule() grants per device, and a thaw at the first grant let the process
        waiting on the other GPU into its call before that GPU's grant)."""
        self.stopper.resume(Target(tuple(box.pids), box.container.cgroup))
        self._signal(box.pids, signal.SIGCONT)

    @staticmethod
    def _signal(pids, sig):
        for p in pids:
            if alive(p):
                os.kill(p, sig)


def alive(pid: int) -> bool:
    """pid is a process (a zombie too); 0 or less never is (kill() would mean a group)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def held_seq(held):
    """(pid, tid) -> the number of the stop BPF lists that thread with in `held` (an admission
    stop), None if none. For the ptrace holder's thread: the table object is made here, in the
    loop's thread, and each call is one map lookup."""
    def seq(pid: int, tid: int) -> int | None:
        try:
            v = held[ct.c_ulonglong(pid << 32 | tid)].value
        except KeyError:
            return None
        return None if v & HELD_OPEN else v & 0xFFFFFFFF
    return seq
