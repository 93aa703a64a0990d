"""Discrete-event simulator of `convgpu enforce` on the paper's scheduling workload.

It calls the daemon's own pure policy code (`enforcer/policies.py`: `assign_new`, `Waiter`,
`Claim`, `safe_assignment`, `schedule`, `reclaim`: the banker's check included), and `_Sim.schedule` mirrors `Enforcer.schedule` in enforcer/decisions.py line for
line, so a policy measured here is the policy the enforcer runs. What the daemon learns from BPF
events, the simulator knows directly:

- arrival: the container's first context; the daemon stops the process at that call, places it
  and assigns A = min(L, unassigned) (`_place` -> `_new_device`), then runs `schedule`.
- each process makes two calls: its context (`overhead` bytes, charged like `--ctx-overhead`)
  and one allocation of its size. A call with U + size <= A proceeds (BPF admission); any other
  stops the process and makes the container a waiter since that instant (a new `Wait`).
- a resumed process makes its next call at once; if that one does not fit either, it is a new
  stall with a new `since`, as in the daemon (a resume pops the `Wait`).
- exit: the container's only process ends `duration` after its allocation succeeded; its whole
  assignment returns to the pool (`_gone`), then `schedule`.

The daemon also reschedules once a second while anyone waits; that pass can never grant
anything here (every pass hands out all free memory while a waiter can take it, and only exits
create free memory), so it is not simulated. The limit of a container is its size plus one
context's overhead: the size is what its program allocates, the context is charged on top.

Times are seconds; memory is bytes. Nothing here reads the clock."""
from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, field

from convgpu.enforcer import policies

from .workload import CAPACITY, Job

# Same-instant events: memory that comes back is seen before a new arrival asks for it.
_EXIT, _CONTINUE, _ARRIVE = 0, 1, 2


@dataclass(frozen=True)
class Outcome:
    name: str
    arrival: float
    size: int
    limit: int
    ready: float | None      # its allocation succeeded (None: never, a deadlock)
    end: float | None
    suspended: float         # seconds stopped, over all its stalls (to the end for a deadlock)
    stalls: int


@dataclass(frozen=True)
class Result:
    policy: str
    overhead: int
    seed: int
    jobs: tuple[Outcome, ...]
    makespan: float          # first arrival to last exit (inf when some never finished)
    peak_assigned: int       # the largest sum of assignments seen (must be <= capacity)
    trace: tuple = ()        # (time, what, name, sum of assignments), with trace=True

    @property
    def deadlocked(self) -> tuple[str, ...]:
        return tuple(o.name for o in self.jobs if o.end is None)

    @property
    def suspended(self) -> list[float]:
        return [o.suspended for o in self.jobs]

    @property
    def mean_suspended(self) -> float:
        return sum(self.suspended) / len(self.jobs)

    @property
    def p95_suspended(self) -> float:
        return percentile(self.suspended, 95)

    @property
    def max_suspended(self) -> float:
        return max(self.suspended)


def percentile(xs, q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), without numpy."""
    s = sorted(xs)
    if not s:
        return math.nan
    k = (len(s) - 1) * q / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


@dataclass
class _Box:
    job: Job
    limit: int
    created: float
    calls: list[int]                # bytes of the calls still to make: [context, allocation]
    assigned: int = 0
    used: int = 0
    pending: int = 0                # bytes of the call it is stopped at
    since: float | None = None      # waiting since (None: not waiting)
    suspended: float = 0.0
    stalls: int = 0
    ready: float | None = None
    end: float | None = None


@dataclass
class _Sim:
    jobs: list[Job]
    policy: str
    capacity: int
    overhead: int
    rng: random.Random
    max_wait: float
    tracing: bool
    boxes: dict[str, _Box] = field(default_factory=dict)    # containers alive
    done: list[_Box] = field(default_factory=list)
    events: list = field(default_factory=list)
    seq: int = 0
    peak: int = 0
    trace: list = field(default_factory=list)

    def push(self, t: float, kind: int, name: str):
        heapq.heappush(self.events, (t, kind, self.seq, name))
        self.seq += 1

    def note(self, t: float, what: str, name: str):
        total = sum(b.assigned for b in self.boxes.values())
        self.peak = max(self.peak, total)
        if self.tracing:
            self.trace.append((t, what, name, total))

    def run(self) -> list[_Box]:
        for j in self.jobs:
            self.push(j.arrival, _ARRIVE, j.name)
        by_name = {j.name: j for j in self.jobs}
        t = 0.0
        while self.events:
            t, kind, _, name = heapq.heappop(self.events)
            if kind == _ARRIVE:
                self.arrive(t, by_name[name])
            elif kind == _EXIT:
                self.exit(t, name)
            elif self.advance(t, self.boxes[name]):   # _CONTINUE: stopped again
                self.schedule(t)
        for b in self.boxes.values():   # still waiting with nothing left to happen: deadlock
            b.suspended += t - b.since  # counted up to the last event
            self.done.append(b)
        return self.done

    # --- what the daemon sees as events ---
    def arrive(self, t: float, job: Job):
        box = _Box(job, job.size + self.overhead, t, [self.overhead, job.size])
        free = self.capacity - sum(b.assigned for b in self.boxes.values())
        box.assigned = policies.assign_new(box.limit, free, self.claims(), self.capacity,
                                           demand=box.calls[0], id=job.name)   # Enforcer._new_device
        self.boxes[job.name] = box
        self.note(t, "arrive", job.name)
        self.advance(t, box)
        self.schedule(t)

    def exit(self, t: float, name: str):
        box = self.boxes.pop(name)                                   # Enforcer._gone
        box.end = t
        self.done.append(box)
        self.note(t, "exit", name)
        self.schedule(t)

    def advance(self, t: float, box: _Box) -> bool:
        """The process makes its next calls until one does not fit (BPF admission stops it:
        True) or it has allocated everything and runs."""
        while box.calls:
            size = box.calls[0]
            if box.used + size > box.assigned:
                box.pending, box.since = size, t
                box.stalls += 1
                self.note(t, "stall", box.job.name)
                return True
            box.used += box.calls.pop(0)
        box.ready = t
        self.push(t + box.job.duration, _EXIT, box.job.name)
        return False

    # --- Enforcer.schedule, for one device ---
    def demand(self, box: _Box) -> int:
        return box.used + box.pending

    def claims(self, waiting: bool = True) -> list[policies.Claim]:   # Enforcer._claims
        """The banker's view of the device: a running container holds its assignment, a waiter
        what it uses (its unused assignment can be reclaimed); waiting=False: runners only."""
        return [policies.Claim(b.job.name, b.limit, max(b.assigned, b.used) if b.since is None else b.used)
                for b in self.boxes.values() if waiting or b.since is None]

    def schedule(self, now: float):
        waiting = [b for b in self.boxes.values() if b.since is not None]
        for box in waiting:   # a free inside the container may be enough (never here)
            if self.demand(box) <= box.assigned:
                top = policies.safe_assignment(policies.Claim(box.job.name, box.limit, box.used),
                                               self.claims(), self.capacity, self.demand(box), box.assigned)
                if top is not None:
                    box.assigned = top
                    self.resume(now, box)
        if not self.grant(now) and self.reclaim(now):   # Enforcer.schedule
            self.grant(now, fit_only=True)

    def reclaim(self, now: float) -> bool:   # Enforcer._reclaim
        waiting = {b.job.name: (b.assigned, b.used) for b in self.boxes.values() if b.since is not None}
        running = any(b.since is None for b in self.boxes.values())
        back = policies.reclaim(waiting, running) if waiting else {}
        for name, held in back.items():
            self.boxes[name].assigned = held
            self.note(now, "reclaim", name)
        return bool(back)

    def grant(self, now: float, fit_only: bool = False) -> bool:     # Enforcer._grant
        resumed = False
        cands = []
        for box in self.boxes.values():
            if box.since is None:
                continue
            # demand > limit (over-limit) cannot happen: limit = context + size
            cands.append(policies.Waiter(id=box.job.name, created=box.created,
                                         suspended_at=box.since, limit=box.limit,
                                         assigned=box.assigned, used=self.demand(box), request=0,
                                         held=box.used))
        free = self.capacity - sum(b.assigned for b in self.boxes.values())
        for g in policies.schedule(self.policy, cands, free, now, self.rng, self.max_wait, fit_only,
                                   self.claims(waiting=False), self.capacity):
            box = self.boxes[g.id]
            box.assigned += g.amount
            self.note(now, "grant", g.id)
            if g.resume:
                self.resume(now, box)
                resumed = True
        return resumed

    def resume(self, now: float, box: _Box):
        box.suspended += now - box.since
        box.since = None
        box.used += box.calls.pop(0)     # the stopped call runs now: it fits
        box.pending = 0
        self.note(now, "resume", box.job.name)
        self.push(now, _CONTINUE, box.job.name)   # then its next call, after this pass


def simulate(jobs: list[Job], policy: str, overhead: int, seed: int = 0,
             capacity: int = CAPACITY, max_wait: float = 30.0, trace: bool = False) -> Result:
    """One run. `seed` seeds the policy's own random choices (rand), as `--seed` does."""
    sim = _Sim(list(jobs), policy, capacity, overhead, random.Random(seed), max_wait, trace)
    boxes = sorted(sim.run(), key=lambda b: b.job.index)
    outs = tuple(Outcome(b.job.name, b.job.arrival, b.job.size, b.limit, b.ready, b.end,
                         b.suspended, b.stalls) for b in boxes)
    ends = [o.end for o in outs]
    makespan = math.inf if None in ends else max(ends) - min(j.arrival for j in jobs)
    return Result(policy, overhead, seed, outs, makespan, sim.peak, tuple(sim.trace))
