"""Actions out: holding who waits, and resuming, thawing, letting go or killing them: every
signal, ptrace release and freezer write the enforcer makes for a wait (the backstop keeps its
own, enforcer/backstop.py). The decider's actuator (enforcer/decisions.py)."""
import contextlib
import logging
import os
import signal
import time

from ..faults import FAULT
from .books import Box
from .failsafe.stall import SignalStopper, Target
from .failsafe.threadhold import ThreadHolder, _tids

log = logging.getLogger(__package__ + ".daemon")   # the Enforcer logs as one: "daemon: ..." (bench/sched, tests read it)


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


class Holds:
    """How a stopped call is held: its thread alone, seized with ptrace (failsafe/threadhold.py;
    started with the probes where stops are signals), or its whole process (no holder, or ptrace
    refused for that process). The freezer holds whole containers and needs none."""

    def __init__(self):
        self.holder: ThreadHolder | None = None

    def current(self) -> ThreadHolder | None:
        return self.holder

    def start(self, held_seq):
        """held_seq(pid, tid): the stop BPF lists that thread with (bpfmaps.held_seq)."""
        self.holder = ThreadHolder(held_seq).start()

    def close(self):
        """It lets go of every thread (after the releases of a stop)."""
        if self.holder is not None:
            self.holder.close()
            self.holder = None

    def whole(self, pid: int) -> bool:
        """A stop holds every thread of pid: ptrace refused it (or no holder), or it has one."""
        return self.holder is None or self.holder.mode(pid) == "process" or len(_tids(pid)) <= 1

    def mode(self, pid: int) -> str:
        return self.holder.mode(pid) if self.holder is not None else "process"

    def forget(self, pid: int):
        if self.holder is not None:
            self.holder.forget(pid)


class Actuator:
    """Handed the stall backend, the holds, BpfMaps (to read `held` at a stop), the pids under
    the preload shim (Books.shimmed: they wait in their threads, never signalled) and swap_in(box,
    dev, ask) (Swapper.resume: a granted wait for a swapped process's footprint is a restore,
    not a thread let go)."""

    def __init__(self, stopper, holds: Holds, maps, shimmed: set[int], swap_in=lambda box, dev, ask: None):
        self.stopper, self.holds, self.maps, self.shimmed, self.swap_in = stopper, holds, maps, shimmed, swap_in
        self.write_assign = maps.write_assign   # the decider's assignments go to BPF as they are

    def hold(self, box: Box, pid: int, ask=None):
        """A call of pid was stopped (ask) or a shim request waits: hold it as the backend does.
        A swapped process's footprint holds nothing (the driver's lock keeps it)."""
        if pid in self.shimmed or (ask is not None and ask.swapin):
            return
        if isinstance(self.stopper, SignalStopper):
            if ask is not None and self.holds.holder is not None:
                self.holds.holder.hold(pid, ask.tid)   # only that thread waits, where ptrace allows
            return
        # freezer mode: hold the whole container in its cgroup (a claim's budget: every
        # container that uses it, issue 48), then drop the signal stop, so that no SIGCONT from
        # inside a container can undo the stall
        try:
            for cg in box.cgroups:
                self.stopper.stall(Target(tuple(box.pids), cg))
            for p in box.pids:
                os.kill(p, signal.SIGCONT) if alive(p) else None
        except Exception as e:
            log.warning("container %s: freezer failed (%s); it stays signal-stopped", box.name, e)

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
        if a.swapin:   # a restore, taken into the books by the swapper: no thread to let go
            return self.swap_in(box, dev, a)
        if self.holds.holder is not None:   # dropped once BPF's `held` forgets the stop (decisions._gone_through)
            box.going.setdefault(dev, {})[a.tid] = a
        self._let_go(a.pid, a.tid, a.seq)
        if FAULT:
            FAULT.hit("resume")   # this call let go, the wait's others (if any) not yet

    def _let_go(self, pid: int, tid: int, seq: int):
        if self.holds.holder is not None:
            self.holds.holder.release(pid, tid, seq)   # the thread alone, or SIGCONT where held whole
        else:
            self.stopper.resume(Target((pid,)))

    def resume(self, box: Box, dev: int, why: str):
        w = box.waiting.pop(dev, None)
        if w is None:
            return
        box.stalled_s += time.monotonic() - w.since
        self.answer_shim(box, dev, w.wakes, {"grant": True})
        freezer = not isinstance(self.stopper, SignalStopper)
        for a in w.asks.values():
            if not freezer or a.swapin:   # the freezer holds no swapped process: restored as the others thaw
                self._send_on(box, dev, a)
        rest = w.pids - self.shimmed - {a.pid for a in w.asks.values()}
        if rest and not freezer:
            self.stopper.resume(Target(tuple(rest)))
        if freezer and box.waiting:   # thawed, its process on another GPU would meet no grant
            log.info("resume %s on GPU%d after %.3f s (%s); it stays frozen until GPU%s %s",
                     box.name, dev, time.monotonic() - w.since, why,
                     ", GPU".join(map(str, sorted(box.waiting))), "settles" if len(box.waiting) == 1 else "settle")
            return
        if freezer:
            self.thaw(box)
        log.debug("resumed %s pids %s (t=%d)", box.name, sorted(w.pids), time.monotonic_ns())
        log.info("resume %s on GPU%d after %.3f s (%s)", box.name, dev, time.monotonic() - w.since, why)

    @staticmethod
    def answer_shim(box: Box, dev: int, wakes, answer: dict):
        """Shim waiters (pid, size, wake): each wake is the broker's (serving/broker.py), which
        holds a granted request's bytes and gives credit before it answers the shim."""
        for _, _, wake in wakes:
            wake(answer)

    def kill(self, pid: int):
        if alive(pid):
            os.kill(pid, signal.SIGKILL)

    def resume_unplaced(self) -> set[int]:
        """At a stop, after admission went off: SIGCONT every process BPF stopped at a call that
        the loop never heard of (stopped, then SIGTERM before the next pass: nobody placed it,
        so no waiter resumes it). BPF lists each such thread in `held` with no HELD_OPEN bit
        (an open held by discovery is the tracer's to resume); passing its recheck drops it."""
        time.sleep(0.02)   # a program past its check when admission went off may still stop one
        pids = self.maps.stopped_unplaced()
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGCONT)
        if pids:
            log.info("stopping: resumed %d processes stopped before they were placed", len(pids))
        return pids

    def thaw(self, box: Box):
        """Freezer: the container runs again, and no process of it stays signal-stopped. Only
        once none of its devices waits: a container frozen on two GPUs has both grants settled
        first (schedule() grants per device, and a thaw at the first grant let the process
        waiting on the other GPU into its call before that GPU's grant)."""
        for cg in box.cgroups:
            self.stopper.resume(Target(tuple(box.pids), cg))
        self.signal(box.pids, signal.SIGCONT)

    def thaw_emptied(self, box: Box, frozen: bool, cgroups=None):
        """Freezer: the container's last CUDA process left (killed while it waited, say), and the
        box goes (or, of a claim's budget, that member). Its cgroup is thawed with it: dropped
        frozen, the next process to join it froze with nobody to thaw it (issue 33, attack 6),
        and so did what else ran there."""
        for cg in cgroups if cgroups is not None else box.cgroups:
            try:   # whether it waited, frozen, not cgroup.events: an exiting task may show it unfrozen
                self.stopper.resume(Target((), cg))   # idempotent
                if frozen:
                    log.info("container %s: its last process left while its cgroup %s was frozen: thawed",
                             box.name, cg)
            except Exception as e:   # StallError, or an OSError reading its state: one line, the loop goes on
                log.warning("container %s: its last process left, and its cgroup %s could not be thawed (%s): "
                            "thaw it by hand", box.name, cg, e)

    @staticmethod
    def signal(pids, sig):
        for p in pids:
            if alive(p):
                os.kill(p, sig)
