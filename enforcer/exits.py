"""Exits: a process whose last thread exits leaves its container at once, but what it held stays
counted against the card until the driver has freed it, which its pidfd tells."""
import logging
import os
import select
import selectors
import time

from .actuator import alive
from .attribution import remember
from .books import Exit

log = logging.getLogger(__package__ + ".daemon")   # the Enforcer logs as one: "daemon: ..." (bench/sched, tests read it)
EXIT_WAIT = 10.0         # s an exit waits for its pidfd (a pid reused meanwhile never fires it)
LOST_S = 10.0            # s an exited member's charge waits in BPF's `gone` for its exit event


class Exits:
    """Handed the tracer (kernel: BPF's `gone` map exists), the books (their exits; a container's
    torn bytes), BpfMaps (`gone`, assignments), the context charges (what NVML measured of the
    process), the history (what it held: a floor for its job's peak), gone(pid) (everyone who
    hears that a process left: the enforcer's), the selector (a pidfd wakes the loop) and
    changed() (a pidfd fired: room for a waiter)."""

    def __init__(self, tracer, books, maps, charges, history, gone, sel, changed):
        self.tracer, self.books, self.maps, self.charges, self.history = tracer, books, maps, charges, history
        self.gone, self.sel, self.changed = gone, sel, changed
        self._vanished: set[int] = set()       # placed pids no process had at the last sweep
        self._waiting: dict[int, float] = {}   # `gone` generation -> when first seen there
        self._before: set[int] | None = None    # `gone` generations at our first sweep: their
        # charges are counted as torn already (Adopter.adopt takes the tearing it finds as freed),
        # and given back again they were counted twice (the --handover torture: over its limit)

    def sweep(self, now: float) -> bool:
        """Exits whose event never came: read by an enforcer killed before it acted on it (the
        kill -9 torture's last enforcer kept such a process in its container for good, its
        context counted and its container's assignment held, while two containers waited
        beside it for 120 s). A placed pid that is no process at two sweeps in a row (its
        event, if any, was read in between) leaves its container as at its exit; an exited
        member's charge that BPF moved to its container's tearing and nobody took for LOST_S
        is given back. True if anything left."""
        vanished = {p for p in self.books.pid_box if not alive(p)}
        lost = vanished & self._vanished
        self._vanished = vanished - lost
        for pid in sorted(lost):
            log.warning("pid %d is gone and its exit was never heard: it leaves its container now", pid)
            self.exiting(pid)
        if not self.tracer.kernel:
            return bool(lost)
        gens = self.maps.gone_entries()
        self._before = gens if self._before is None else self._before & gens
        self._waiting = {g: self._waiting.get(g, now) for g in gens - self._before}
        given = 0
        for g in [g for g, since in self._waiting.items() if now - since >= LOST_S]:
            del self._waiting[g]
            key, charge = self.maps.take_torn(g)
            if charge:
                given += 1
                self.torn(Exit(0, now, {}, self.books.by_key.get(key), charge))
        if given:
            log.warning("%d exits' charges waited %.0f s for their exit event: given back", given, LOST_S)
        return bool(lost or given)

    def reap_due(self, now: float) -> bool:
        """The exits whose pidfd fired (or that waited EXIT_WAIT); True if any. For callers of
        step() alone: run() wakes on them in select()."""
        exits = self.books.exits
        if not exits:
            return False
        late = [fd for fd, x in exits.items() if now > x.until]
        due = set(select.select(list(exits), [], [], 0)[0] + late)
        for fd in due:
            self.reap(fd)
        return bool(due)

    def exiting(self, pid: int, tracked: int = 0, at: int = 0, contexts: int = 0, gen: int = 0):
        """The last thread of pid is in exit: it leaves its container now, but the driver frees
        its device memory only when the kernel closes its files, after the event (do_exit: the
        tracepoint, exit_mm, exit_files), 55 ms later on the H100. Until its pidfd becomes
        readable (exit_notify) those bytes are held against the card's physical room (see
        Books.room), so a waiter resumes at once where the card has room for both, and only
        once they are back where it has not. tracked: its live bytes and context charges;
        at: the exit tracepoint's time (CLOCK_MONOTONIC ns), for the timeline; contexts: how
        many it had (measured by NVML: what NVML said; else the estimate each); gen: its BPF
        generation, under which BPF left what it moved to its container's `tearing` (until
        the pidfd fires, the container holds it: a sibling or a resumed waiter cannot take
        its place while the driver still holds it, issue 23 part 2)."""
        t = time.monotonic_ns()
        box = self.books.pid_box.get(pid)
        devs = sorted(box.assigned) if box else []
        # on every device of its container: the event gives one total (where, BPF has forgotten)
        excess = self.charges.excess
        measured = [excess[(pid, d)] for d in devs if (pid, d) in excess]
        unmeasured = max(0, contexts - sum(n for _, n in measured))
        held = (tracked + sum(over for over, _ in measured)
                + unmeasured * max((self.charges.ctx(d) for d in devs), default=0))
        log.debug("pid %d exiting, %d bytes held (kernel t=%d) (t=%d)", pid, held, at, t)   # bench.sched.resume
        charge = self.maps.take_torn(gen)[1] if gen and self.tracer.kernel else {}
        if box is not None and len(devs) == 1:   # what it held at its exit: a floor for its job's peak
            self.history.exited(box.container.id, pid, {devs[0]: held})
        if box is not None:   # what NVML lists under its pid once this exit settled is memory it left
            remember(self.books, pid, box)
        self.gone(pid)
        x = Exit(pid, time.monotonic() + EXIT_WAIT, {d: held for d in devs}, box, charge)
        if not held or not devs:
            return self.torn(x)
        try:
            fd = os.pidfd_open(pid)
        except OSError:     # reaped already
            return self.torn(x)
        self.books.exits[fd] = x
        if select.select([fd], [], [], 0)[0]:
            self.reap(fd)
            return
        self.sel.register(fd, selectors.EVENT_READ, lambda _mask, fd=fd: (self.reap(fd), self.changed()))

    def reap(self, fd: int):
        x = self.books.exits.pop(fd)
        try:
            self.sel.unregister(fd)
        except KeyError:
            pass
        os.close(fd)
        self.torn(x)
        log.debug("pid %d gone (t=%d)", x.pid, time.monotonic_ns())

    def torn(self, x: Exit):
        """The driver has freed an exited process's memory (or could have: its files are closed,
        unless another process keeps them): its container holds it no more as its exit."""
        gone = self.books.departed.get(x.pid)
        if gone is not None and not gone.settled:
            gone.settled = time.monotonic()
        box = x.box
        if box is None or not x.charge or self.books.by_key.get(box.key) is not box:
            return
        for d, c in x.charge.items():
            box.torn[d] = box.torn.get(d, 0) + c
            if d in box.assigned:
                self.maps.write_assign(box, d)
