"""Decisions: which waiter resumes, who is granted what, what is reclaimed when every
container waits. The policies themselves are pure (enforcer/policies.py, shared with the
simulator in bench/sched); this is the glue that feeds them the books and carries out the
answer through Actions."""
import logging
import os
import signal
import time

from ..units import format_size
from . import policies
from .actions import alive
from .books import Box

log = logging.getLogger(__package__ + ".daemon")   # the Enforcer logs as one: "daemon: ..." (bench/sched, tests read it)


class Decisions:
    """Part of Enforcer (enforcer/daemon.py): schedule() and what it decides."""

    def schedule(self):
        now = time.monotonic()
        for dev in sorted(self.capacity):
            if self._room(dev) < 0:   # an exit's memory is still in the driver and the card is full
                continue              # of assignments: any resume could fail there; its pidfd wakes us
            waiting = [b for b in self.boxes.values() if dev in b.waiting]
            for box in waiting:   # a free inside the container may be enough
                demand = self._demand(box, dev)
                if demand <= box.assigned[dev] and demand <= self._limit(box, dev):
                    # running, it may use all of its assignment: only as much as is safe
                    me = policies.Claim(box.container.id, self._limit(box, dev), self._held(box, dev))
                    top = policies.safe_assignment(me, self._claims(dev), self.capacity.get(dev, 0),
                                                   demand, box.assigned[dev])
                    if top is not None:
                        if top < box.assigned[dev]:
                            box.assigned[dev] = top
                            self._write_assign(box, dev)
                        self._resume(box, dev, "fits its assignment")
            if (not self._grant(dev, now) and not self._tearing(dev) and self._reclaim(dev)
                    and not self._grant(dev, now, fit_only=True)):
                self._deadlock(dev)   # on the reclaimed pool, only who can run: nobody can

    def _grant(self, dev: int, now: float, fit_only: bool = False) -> bool:
        """One pass of the policy over the waiters on dev; True if it resumed one."""
        cands = []
        for box in self.boxes.values():
            if dev not in box.waiting:
                continue
            demand = self._demand(box, dev)
            if demand > self._limit(box, dev):
                self._over_limit(box, dev, demand)
                continue
            w = box.waiting[dev]
            cands.append(policies.Waiter(id=box.container.id, created=box.created,
                                         suspended_at=w.since, limit=self._limit(box, dev),
                                         assigned=box.assigned[dev], used=demand, request=0,
                                         held=self._held(box, dev)))
        free = self._free(dev)
        resumed = False
        ids = {c.id for c in cands}
        others = [c for c in self._claims(dev) if c.id not in ids]   # runners, and the stuck
        for g in policies.schedule(self.policy, cands, free, now, self.rng, self.max_wait, fit_only,
                                   others, self.capacity.get(dev, 0)):
            box = self.boxes[g.id]
            box.assigned[dev] += g.amount
            box.grants += 1
            self._write_assign(box, dev)
            log.info("grant %s to %s on GPU%d (assigned %s)", format_size(g.amount), box.name,
                     dev, format_size(box.assigned[dev]))
            if g.resume:
                self._resume(box, dev, f"policy {self.policy}")
                resumed = True
        return resumed

    def _reclaim(self, dev: int) -> bool:
        """Every container on dev paused, nobody resumed: see policies.reclaim."""
        on = [b for b in self.boxes.values() if dev in b.assigned]
        waiting = {b.container.id: (b.assigned[dev], self._held(b, dev)) for b in on if dev in b.waiting}
        within = any(not b.waiting[dev].over_limit for b in on if dev in b.waiting)
        back = policies.reclaim(waiting, any(dev not in b.waiting for b in on), within) if waiting else {}
        for cid, held in back.items():
            box = self.boxes[cid]
            log.warning("reclaim %s from %s on GPU%d: every container waits, none can run on what "
                        "it was given", format_size(box.assigned[dev] - held), box.name, dev)
            box.assigned[dev] = held
            self._write_assign(box, dev)
        return bool(back)

    def _deadlock(self, dev: int):
        """What waiters hold themselves (their contexts) leaves too little for any of them:
        only an exit ends it. Said once, until someone runs again. With every grant and
        placement safe (policies.schedule) the policies never lead here; a state made unsafe
        from outside can (a waiter over its limit holding memory, a limit raised at run time,
        a context measured larger than charged)."""
        if dev in self._stuck:
            return
        self._stuck.add(dev)
        free = self._free(dev)
        log.warning("GPU%d deadlocked: every container waits, and none can run on the %s free (the "
                    "rest is held by the waiters themselves, their contexts): it ends when one of them "
                    "exits", dev, format_size(free))

    def _over_limit(self, box: Box, dev: int, demand: int):
        w = box.waiting[dev]
        if not w.over_limit:
            w.over_limit = True
            box.over_limits += 1
            log.warning("container %s GPU%d: needs %s, above its limit %s: %s", box.name, dev,
                        format_size(demand), format_size(self._limit(box, dev)),
                        "killing it" if self.over_limit == "kill" else "stalled until the limit is raised")
        if w.wakes:   # the shim can fail the call: a real out-of-memory error
            self.broker.granted(box, dev, w.wakes, {"deny": f"{box.name} needs {format_size(demand)}, "
                                                            f"above its limit {format_size(self._limit(box, dev))}"})
            for pid, size, _ in w.wakes:
                w.unreserved -= size
                w.pids.discard(pid)
            w.wakes.clear()
            if not w.pids:
                del box.waiting[dev]
            return
        if self.over_limit == "kill":
            for p in list(w.pids):
                os.kill(p, signal.SIGKILL) if alive(p) else None
