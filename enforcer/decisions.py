"""The decider: which waiter resumes, who is granted what, what is reclaimed when every
container waits. The policies themselves are pure (enforcer/policies.py, shared with the
simulator in bench/sched; enforcer/within.py within a container); the decider feeds them the
books (enforcer/books.py) and carries out the answer through an actuator (enforcer/actuator.py,
writing assignments through enforcer/bpfmaps.py); tests/unit/test_decider.py drives one with
plain books and a recording actuator, without an Enforcer or a kernel.

The actuator (`act`): write_assign(box, dev) (a new assignment to BPF), resume(box, dev, why)
(the whole wait), resume_asks(box, dev, asks, why) (some stopped calls), answer_shim(box, dev,
wakes, answer) (shim waiters), kill(pid) (--over-limit kill)."""
import logging
import os
import time

from ..faults import FAULT
from ..units import format_size
from . import policies, within
from .books import Books, Box
from .tenants.limits import unknown

NEWCOMER_S = 2.0   # s a process just placed may take to its first allocation while the next one waits on it

log = logging.getLogger(__package__ + ".daemon")   # the Enforcer logs as one: "daemon: ..." (bench/sched, tests read it)


class Decider:
    """schedule() and what it decides. Its own state: which devices were said deadlocked
    (`stuck`, until someone runs again) and which containers' newcomers wait this pass.
    process_holds(box, dev): pid -> (what it holds on dev, of that its contexts);
    holder(): the ThreadHolder, or None (stops hold whole processes)."""

    def __init__(self, books: Books, act, policy: str, rng, max_wait: float, over_limit: str = "stall",
                 process_holds=lambda box, dev: {}, holder=lambda: None, swap=None):
        policies.POLICIES[policy]   # validated by the CLI; KeyError here is a bug
        self.books, self.act, self.policy, self.rng = books, act, policy, rng
        self.max_wait, self.over_limit = max_wait, over_limit
        self.process_holds, self.holder = process_holds, holder
        self.swap = swap   # the Swapper (enforcer/swap/): room made by swapping, asked for, never driven here
        self.stuck: set[int] = set()     # devices where every container waits and none can run
        self._held_back: set = frozenset()   # keys of containers whose newcomer waits this pass (_settling)

    def schedule(self):
        now = time.monotonic()
        self._gone_through()
        for dev in sorted(self.books.capacity):
            if self.books.room(dev) < 0 and not self._room_back(dev, now):   # any resume could fail there
                continue
            self._held_back = set()
            waiting = [b for b in self.books.boxes.values() if dev in b.waiting]
            for box in waiting:
                self._saw_frees(box, dev, now)
            for box in waiting:   # a free inside the container may be enough
                demand = self.books.demand(box, dev)
                if demand > box.assigned[dev] or demand > self.books.limit(box, dev):
                    self._serve(box, dev, now)   # not all of them: those that fit, one by one
                    continue
                firsts = [a.pid for a in box.waiting[dev].asks.values() if a.first]
                if (firsts and not self.books.freezer
                        and min(box.assigned[dev], self.books.limit(box, dev)) - demand < self.books.ctx_of(dev)):
                    if not self._serve(box, dev, now):   # newcomers one at a time (_settling)
                        self._held_back.add(box.key)     # neither granted nor called deadlocked meanwhile
                    continue
                # running, it may use all of its assignment: only as much as is safe
                me = policies.Claim(box.container.id, self.books.limit(box, dev), self.books.held(box, dev))
                top = policies.safe_assignment(me, self.books.claims(dev), self.books.capacity.get(dev, 0),
                                               demand, box.assigned[dev])
                if top is not None:
                    if top < box.assigned[dev]:
                        box.assigned[dev] = top
                        self.act.write_assign(box, dev)
                    self.act.resume(box, dev, "fits its assignment")
                    self.stuck.discard(dev)   # someone runs again
                    box.placed.update((q, now) for q in firsts)
            granted = self._grant(dev, now)
            if not granted and waiting and self.swap is not None:
                self._swap_for(dev, now)   # --swap-idle: idle holders out, for a waiter the full GPU holds back
            if not granted and not self._held_back and not self.books.tearing(dev):
                # on the reclaimed pool, only who can run: nobody can; or nothing to reclaim and
                # everyone on it paused (assignments already what each holds: a limit raised at run time)
                if (not self._grant(dev, now, fit_only=True) if self._reclaim(dev, now) else self._all_paused(dev, now)):
                    self._deadlock(dev, now)

    def _serve(self, box: Box, dev: int, now: float) -> bool:
        """Within a container: resume the stopped calls that fit its assignment now, each on
        its own (a wait belongs to a thread, or to a process held whole; within.resumable
        chooses, from the books as plain values). Then circular waits are looked for. True if
        one resumed."""
        w = box.waiting.get(dev)
        if w is None or not w.asks:
            return False
        if self.books.freezer:   # the freezer holds the container
            self._circular(box, dev, w, now)               # whole: it resumes whole (schedule)
            return False
        self._drop_dead_asks(box, dev, w)
        for a in list(w.asks.values()):
            if a.over_limit:
                self._over_limit(box, dev, a.size, a)
        taken = self.books.taken(box, dev)
        units = self._units(w)
        holds = self.process_holds(box, dev) if len(units) > 1 else {}

        def settling(pid: int, room_after: int) -> bool:
            if self._settling(box, dev, pid, room_after, now, holds):
                return True
            box.placed[pid] = now    # the next newcomer of this pass waits on it
            return False
        go = within.resumable(units, min(box.assigned[dev], self.books.limit(box, dev)) - taken - w.unreserved,
                              self.books.limit(box, dev) - taken, holds, settling)
        if go:
            self.act.resume_asks(box, dev, [a for u in go for a in u], "fits its assignment")
            self.stuck.discard(dev)
            return True
        self._circular(box, dev, w, now)
        return False

    def _grant(self, dev: int, now: float, fit_only: bool = False) -> bool:
        """One pass of the policy over the waiters on dev; True if it resumed one."""
        cands = []
        for box in self.books.boxes.values():
            if dev not in box.waiting or box.key in self._held_back or \
                    (self.swap is not None and self.swap.behind(box, dev)):
                continue
            want = self._want(box, dev, box.waiting[dev])
            if want is None:
                continue
            w = box.waiting[dev]
            cands.append(policies.Waiter(id=box.container.id, created=box.created,
                                         suspended_at=w.since, limit=self.books.limit(box, dev),
                                         assigned=box.assigned[dev], used=want, request=0,
                                         held=self.books.held(box, dev)))
        free = self.books.free(dev)
        resumed = False
        ids = {c.id for c in cands}
        others = [c for c in self.books.claims(dev) if c.id not in ids]   # runners, and the stuck
        for g in policies.schedule(self.policy, cands, free, now, self.rng, self.max_wait, fit_only,
                                   others, self.books.capacity.get(dev, 0)):
            box = self.books.boxes[g.id]
            box.assigned[dev] += g.amount
            box.grants += 1
            self.act.write_assign(box, dev)
            if FAULT:
                FAULT.hit("grant")   # granted in BPF, its waiter not resumed
            log.info("grant %s to %s on GPU%d (assigned %s)", format_size(g.amount), box.name,
                     dev, format_size(box.assigned[dev]))
            if g.resume:
                if self.books.demand(box, dev) <= box.assigned[dev]:
                    self.act.resume(box, dev, f"policy {self.policy}")
                    self.stuck.discard(dev)
                    resumed = True
                else:
                    resumed = self._serve(box, dev, now) or resumed
        return resumed

    def _saw_frees(self, box: Box, dev: int, now: float):
        """When a waiting container last gave memory back (its threads still running may free:
        Books._paused, _circular)."""
        w = box.waiting[dev]
        taken = self.books.taken(box, dev) + w.unreserved
        if taken < w.held_was:
            w.freed_at = now
        w.held_was = taken

    def _reclaim(self, dev: int, now: float) -> bool:
        """Every container on dev paused, nobody resumed: see policies.reclaim."""
        on = [b for b in self.books.boxes.values() if dev in b.assigned]
        paused = [b for b in on if self.books.paused(b, dev, now)]
        waiting = {b.container.id: (b.assigned[dev], self.books.held(b, dev)) for b in paused}
        within = any(not b.waiting[dev].over_limit for b in paused)
        back = policies.reclaim(waiting, len(paused) < len(on), within) if waiting else {}
        for cid, held in back.items():
            box = self.books.boxes[cid]
            log.warning("reclaim %s from %s on GPU%d: every container waits, none can run on what "
                        "it was given", format_size(box.assigned[dev] - held), box.name, dev)
            box.assigned[dev] = held
            self.act.write_assign(box, dev)
        return bool(back)

    def _room_back(self, dev: int, now: float) -> bool:
        """The card's room is below zero (Books.room): True once it is not. Where an exit's memory
        is still in the driver, its pidfd wakes us when it is freed. Otherwise containers hold
        more than they were assigned (what ran unchecked while no enforcer admitted, a limit
        raised at run time, a context measured larger than charged) and nothing would wake us:
        every waiter stayed stopped beside memory nobody used (the kill -9 torture: three
        containers, 1.3 GiB held of 1.8, none resumed in 120 s). So waiters that cannot go on by
        themselves (Books.paused) give back what they were assigned and do not hold, the most
        unused first, as much as the card lacks: as policies.reclaim at a deadlock."""
        if self.books.tearing(dev):
            return False
        paused = [b for b in self.books.boxes.values() if dev in b.assigned and self.books.paused(b, dev, now)]
        for box in sorted(paused, key=lambda b: self.books.held(b, dev) - b.assigned[dev]):
            lack, held = -self.books.room(dev), self.books.held(box, dev)
            if lack <= 0:
                break
            if box.assigned[dev] <= held:
                continue
            back = min(lack, box.assigned[dev] - held)
            log.warning("reclaim %s from %s on GPU%d: the containers on it hold %s more than the card has "
                        "beside their assignments, and it waits", format_size(back), box.name, dev,
                        format_size(lack))
            box.assigned[dev] -= back
            self.act.write_assign(box, dev)
        return self.books.room(dev) >= 0

    def _all_paused(self, dev: int, now: float) -> bool:
        """Every container on dev waits and cannot go on by itself (Books.paused), some within
        its limit."""
        on = [b for b in self.books.boxes.values() if dev in b.assigned]
        return bool(on) and all(self.books.paused(b, dev, now) for b in on) and \
            any(not b.waiting[dev].over_limit for b in on)

    def _lacks(self, dev: int) -> dict[str, int]:
        """What each waiter on dev lacks to run (its want beyond its assignment and the free
        memory), for those a grant could help (within their limit)."""
        out = {}
        for box in self.books.boxes.values():
            w = box.waiting.get(dev)
            want = self._want(box, dev, w) if w is not None else None
            if want is not None and want <= self.books.limit(box, dev):
                out[box.container.id] = max(0, want - box.assigned[dev] - self.books.free(dev))
        return out

    def _swap_for(self, dev: int, now: float):
        """A waiter the full GPU holds back (not its own limit): the swapper may take idle holders
        out (--swap-idle; it says whom and why)."""
        lacks = [n for n in self._lacks(dev).values() if n > 0]
        if lacks:
            self.swap.make_room(dev, min(lacks), now)

    def _deadlock(self, dev: int, now: float):
        """What waiters hold themselves (their contexts) leaves too little for any of them:
        one side goes out to host memory where the swapper can take it (no kill: docs/
        SCHEDULING.md), else only an exit ends it. Said once, until someone runs again. With
        every grant and placement safe (policies.schedule) the policies never lead here; a state
        made unsafe from outside can (a waiter over its limit holding memory, a limit raised at
        run time, a context measured larger than charged)."""
        if self.swap is not None and self.swap.break_deadlock(dev, self._lacks(dev), now):
            return
        if dev in self.stuck:
            return
        self.stuck.add(dev)
        free = self.books.free(dev)
        log.warning("GPU%d deadlocked: every container waits, and none can run on the %s free (the "
                    "rest is held by the waiters themselves, their contexts): it ends when one of them "
                    "exits", dev, format_size(free))

    def _want(self, box: Box, dev: int, w) -> int | None:
        """What the policy is asked to make room for (its `used`): what the container holds
        and reserves, its shim requests, and its stopped calls in the order they stopped while
        they fit the limit together (at least the first). None: nothing a grant could help
        (every request above the limit)."""
        taken = self.books.taken(box, dev)
        if w.wakes and taken + w.unreserved > self.books.limit(box, dev):
            self._over_limit(box, dev, taken + w.unreserved)
        for a in list(w.asks.values()):
            if a.over_limit:
                self._over_limit(box, dev, a.size, a)
        w = box.waiting.get(dev)
        if w is None:
            return None
        asks = sorted((a for a in w.asks.values() if not a.over_limit), key=lambda a: a.since)
        w.over_limit = not asks and not w.unreserved
        if w.over_limit:
            return None
        if self.books.freezer:
            return self.books.demand(box, dev)   # the freezer resumes the container whole
        want = taken + w.unreserved
        for i, a in enumerate(asks):
            if i and want + a.need > self.books.limit(box, dev):
                break
            want += a.need
        return want

    def _units(self, w) -> list[list]:
        """Who resumes together: a thread alone, or every stopped thread of a process held
        whole (ptrace refused: one SIGCONT resumes them all)."""
        out, whole, holder = [], {}, self.holder()
        for a in w.asks.values():
            if holder is None or holder.mode(a.pid) == "process":
                whole.setdefault(a.pid, []).append(a)
            else:
                out.append([a])
        return out + list(whole.values())

    def _settling(self, box: Box, dev: int, pid: int, room_after: int, now: float, holds=None) -> bool:
        """A process's first context waits while it would leave its container less room than
        one more context and another process of the container, placed less than NEWCOMER_S
        ago, has not allocated yet: that one is about to ask for the room this context would
        take. (Six workers started at once beside a server each got a context, and none had
        room for its first 256 MiB: a circular wait, for good.) Decided again within a second
        (the loop's pass while anyone waits), by which time the other has allocated or its
        time is up."""
        if room_after >= self.books.ctx_of(dev):
            return False
        fresh = [q for q, t in box.placed.items() if q != pid and now - t < NEWCOMER_S]
        if not fresh:
            return False
        holds = holds or self.process_holds(box, dev)
        waits = [q for q in fresh if holds.get(q, (0, 0))[0] <= holds.get(q, (0, 0))[1]]
        if waits and pid not in box.settling:   # said once
            box.settling.add(pid)
            log.info("container %s GPU%d: pid %d's first context waits for pid %s to allocate: it would leave "
                     "less than a context's room", box.name, dev, pid, ", ".join(map(str, waits)))
        return bool(waits)

    def _gone_through(self):
        """Resumed calls (Box.going) whose thread passed its recheck (BPF reserved them: its
        `held` entry for that stop is gone), stopped again (a new stop: a new ask) or died."""
        holder = self.holder()
        if holder is None:
            return
        for box in self.books.boxes.values():
            for dev, going in box.going.items():
                for tid, a in list(going.items()):
                    if holder.held_seq(a.pid, tid) != a.seq:
                        del going[tid]

    def _drop_dead_asks(self, box: Box, dev: int, w):
        """A thread killed while stopped (its process lives on): its call went with it."""
        for tid, a in list(w.asks.items()):   # a swapped process's footprint holds no thread
            if a.tid != a.pid and not a.swapin and not os.path.exists(f"/proc/{a.pid}/task/{a.tid}"):
                del w.asks[tid]

    def _circular(self, box: Box, dev: int, w, now: float):
        """Waits that only the container's own processes could end: no stopped call fits even
        in its whole limit beside what it holds, so no grant helps, only a free of its own;
        and the container is paused (Books.paused): every process of it waits, so none is left
        running to free or exit. Certain at once where each is stopped whole (the freezer,
        ptrace refused, one thread); where threads of a waiting process still run, once none
        of them freed anything for CIRCULAR_S. A process with no call stopped runs: its siblings'
        wait is an ordinary one (the H100's four CuPy jobs, two holding memory for 4 s, were
        called circular at 3 s). Said in the log and `status`, and --over-limit applies: stall
        keeps them (a free, an exit or a new limit still resumes them), kill ends the newest
        waiter's process."""
        taken = self.books.taken(box, dev) + w.unreserved
        units = [u for u in self._units(w) if not any(a.over_limit for a in u)]
        if not units or any(taken + sum(a.need for a in u) <= self.books.limit(box, dev) for u in units):
            w.circular = False
            return
        asking = {a.pid for a in w.asks.values()}
        if w.circular or not (self.books.freezer or self.books.paused(box, dev, now)):
            return
        w.circular = True
        box.circulars += 1
        need = min(sum(a.size for a in u) for u in units)
        newest = max(w.asks.values(), key=lambda a: a.since)
        log.warning("container %s GPU%d: circular wait: %d stopped calls (pids %s) each need at least %s more, "
                    "and only its own processes hold it (%s held of its limit %s): %s", box.name, dev,
                    len(w.asks), ", ".join(map(str, sorted(asking))), format_size(need), format_size(taken),
                    format_size(self.books.limit(box, dev)),
                    f"killing pid {newest.pid} (the newest waiter)" if self.over_limit == "kill"
                    else "stalled until one of them exits, frees, or its limit is raised")
        if self.over_limit == "kill":
            self.act.kill(newest.pid)

    def _over_limit(self, box: Box, dev: int, demand: int, ask=None):
        w = box.waiting[dev]
        if ask is not None:   # a stopped call that can never fit
            if not ask.said and unknown(box.source):   # held; --over-limit kill is suspended meanwhile
                ask.said = True
                log.warning("container %s GPU%d: needs %s, held: its limit is %s", box.name, dev,
                            format_size(demand), box.source)
            if not ask.said:
                ask.said = True
                box.over_limits += 1
                log.warning("container %s GPU%d: needs %s, above its limit %s: %s", box.name, dev,
                            format_size(demand), format_size(self.books.limit(box, dev)),
                            f"killing pid {ask.pid}" if self.over_limit == "kill" else "stalled until the limit is raised")
                if self.over_limit == "kill":
                    self.act.kill(ask.pid)
            return
        if not w.over_limit:
            w.over_limit = True
            box.over_limits += 1
            log.warning("container %s GPU%d: needs %s, above its limit %s: %s", box.name, dev,
                        format_size(demand), format_size(self.books.limit(box, dev)),
                        "killing it" if self.over_limit == "kill" else "stalled until the limit is raised")
        if w.wakes:   # the shim can fail the call: a real out-of-memory error
            self.act.answer_shim(box, dev, w.wakes, {"deny": f"{box.name} needs {format_size(demand)}, "
                                                            f"above its limit {format_size(self.books.limit(box, dev))}"})
            for pid, size, _ in w.wakes:
                w.unreserved -= size
                w.pids.discard(pid)
            w.wakes.clear()
            if not w.pids:
                del box.waiting[dev]
            return
        if self.over_limit == "kill":
            for p in list(w.pids):
                self.act.kill(p)
