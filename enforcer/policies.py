"""Which paused container gets GPU memory back, and how much (ConVGPU sections III-D, III-E).

Model: container c has a limit L_c, an assignment A_c <= L_c (assignments sum to at most the
capacity) and a usage U_c. An allocation of `size` with U_c + size <= A_c proceeds; with
A_c < U_c + size <= L_c the container is paused and becomes a *waiter* (`Waiter`). When memory
comes back (a free, an exit, a limit change) `schedule` repeatedly picks a waiter by policy and
raises its assignment towards its full limit, as the paper does ("guarantees all GPU memory which
the container firstly requested"): grant = min(L_c - A_c, free). The waiter resumes if the grant
covers its pending need; otherwise it keeps the partial grant and stays paused. The rest of the
free memory goes to the next pick, until none is left or no waiter can use it.

Policies (ties always broken by `created`, then `id`, so results never depend on input order):
  fifo  the waiter whose *container* was created first (not the first suspended), as the paper.
  bf    Best-Fit: the waiter whose missing memory (L_c - A_c) is the largest that is <= the
        remaining free memory; if none fits, the one missing the least.
  ru    Recent-Use: the most recently suspended waiter.
  rand  uniformly at random, drawn from the caller's seedable `random.Random`.
  bfa   Best-Fit with aging (ours), three rules in order:
        1. finish what was started: a waiter that already holds part of its limit
           (assigned > 0) is served first, the earliest created first;
        2. aging: a waiter suspended for longer than `max_wait` seconds (strictly: now -
           suspended_at > max_wait) next, the longest-suspended first;
        3. otherwise exactly bf.
        Why rule 1: memory granted partially sits idle until its holder can run. ru and rand
        leave such holders behind and hand the next memory to someone else, so several waiters
        end up holding slices that add up to the whole GPU with none of them able to run: a
        deadlock once the running containers have exited (the simulator finds it in nearly
        every 38-container run under ru and rand, and it hit an earlier bfa whose rule 2 alone
        re-ordered waiters). bf leaves slices behind too (no deadlock seen, but idle memory). With rule 1 at most one waiter
        is ever partly assigned -- when memory comes back it goes to that one first -- so in
        the paper's workload (each container asks for its whole limit) waiters can never hold
        the GPU between them. It also gives back the packing bf loses to idle slices: over
        500 seeds of the paper's workload at 38 containers, bfa finishes 8.5 +- 3.5 s sooner
        than bf (66 MiB contexts; 46 +- 9 s with the H100's 519 MiB) and halves fifo's mean
        suspended time, with a lower p95 than both (docs/SCHEDULING.md).
        Why rule 2: bf alone may starve a large waiter for as long as smaller ones keep
        fitting; aging bounds that to about `max_wait` plus the time until it is fully
        assigned (rule 1 then keeps it first). max_wait=0 serves the longest-suspended first;
        math.inf disables aging. Default MAX_WAIT.
        Rule 1 is no guarantee in general: containers that ran with part of their limit and
        then stall hold slices too (only taking back unused assignments could fix that).

Safety: whatever the policy, a grant that resumes a waiter and a placement pass the banker's
check first (`finishers`, `safe_assignment`; `schedule` says what counts as held), so the
policy only ever chooses among moves after which every container can still reach its limit;
with `reclaim` this makes every policy deadlock-free (docs/SCHEDULING.md: 0 deadlocks in 9,000
simulated runs per policy and context size, where ru and rand had 6,502 and 6,432).

Pure functions: nothing here reads the clock, the system or BPF; inputs are never mutated.
A waiter already at its limit (missing == 0) is never picked: more memory cannot help it, it is
over its limit and the enforcer handles that case."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Sequence


# bfa's aging threshold (s): the scheduling simulator's best trade-off on the paper's workload
# (runs of 5-45 s): 30 s makes bfa almost fifo, 120-180 s keeps bf's makespan or better and
# fifo's tail (docs/SCHEDULING.md, "max_wait").
MAX_WAIT = 180.0


@dataclass(frozen=True)
class Waiter:
    id: str              # container id
    created: float       # when the container was first seen (fifo order)
    suspended_at: float  # when its pending allocation paused it (ru, bfa)
    limit: int           # L_c
    assigned: int        # A_c
    used: int            # U_c
    request: int         # size of the pending allocation that paused it
    held: int | None = None  # what it holds now (bytes, contexts); None: `used`

    @property
    def holds(self) -> int:
        """What the banker's check counts for it: what it uses, not what it was assigned."""
        return self.used if self.held is None else self.held

    @property
    def missing(self) -> int:
        """Bytes still between the assignment and the limit: the most a grant can give."""
        return self.limit - self.assigned

    @property
    def need(self) -> int:
        """Bytes of assignment still lacking for the pending request (> 0 while waiting)."""
        return self.used + self.request - self.assigned


@dataclass(frozen=True)
class Grant:
    id: str
    amount: int   # bytes added to the assignment
    resume: bool  # the request now fits: resume the container


def _tie(w: Waiter) -> tuple:
    return (w.created, w.id)


# Every policy: (candidates, free, now, rng, max_wait) -> one of the candidates. Candidates are
# non-empty and all have missing > 0; free > 0. Unused arguments keep the signature uniform.
Policy = Callable[[Sequence[Waiter], int, float, random.Random, float], Waiter]


def fifo(ws: Sequence[Waiter], free: int, now: float, rng: random.Random,
         max_wait: float) -> Waiter:
    return min(ws, key=_tie)


def best_fit(ws: Sequence[Waiter], free: int, now: float, rng: random.Random,
             max_wait: float) -> Waiter:
    fits = [w for w in ws if w.missing <= free]
    if fits:  # largest missing that fits = least left over; earliest created on ties
        return min(fits, key=lambda w: (-w.missing, *_tie(w)))
    # Nothing fits: the one closest to being completed by a later free.
    return min(ws, key=lambda w: (w.missing, *_tie(w)))


def recent_use(ws: Sequence[Waiter], free: int, now: float, rng: random.Random,
               max_wait: float) -> Waiter:
    return min(ws, key=lambda w: (-w.suspended_at, *_tie(w)))


def rand(ws: Sequence[Waiter], free: int, now: float, rng: random.Random,
         max_wait: float) -> Waiter:
    # Sort first so that one seed gives one choice whatever order the caller listed them in.
    return rng.choice(sorted(ws, key=_tie))


def best_fit_aging(ws: Sequence[Waiter], free: int, now: float, rng: random.Random,
                   max_wait: float) -> Waiter:
    holding = [w for w in ws if w.assigned > 0]
    if holding:
        return min(holding, key=_tie)
    overdue = [w for w in ws if now - w.suspended_at > max_wait]
    if overdue:
        return min(overdue, key=lambda w: (w.suspended_at, *_tie(w)))
    return best_fit(ws, free, now, rng, max_wait)


POLICIES: dict[str, Policy] = {
    "fifo": fifo,
    "bf": best_fit,
    "ru": recent_use,
    "rand": rand,
    "bfa": best_fit_aging,
}


def _policy(name: str) -> Policy:
    try:
        return POLICIES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown policy {name!r}: expected one of "
                         f"{', '.join(sorted(POLICIES))}") from None


def _check(policy: str, max_wait: float) -> Policy:
    # Checked before any early return, so a typo fails even when nobody waits.
    fn = _policy(policy)
    if not max_wait >= 0:
        raise ValueError(f"max_wait must be >= 0 seconds, got {max_wait!r}")
    return fn


def pick(policy: str, waiters: Sequence[Waiter], free: int, now: float,
         rng: random.Random, max_wait: float = MAX_WAIT) -> Waiter | None:
    """The waiter `policy` serves first with `free` bytes; None when no waiter can use memory
    (free <= 0, or every waiter is already at its limit). The policy's preference alone, before
    any safety check (`schedule` applies that)."""
    fn = _check(policy, max_wait)
    candidates = [w for w in waiters if w.missing > 0]
    if free <= 0 or not candidates:
        return None
    return fn(candidates, free, now, rng, max_wait)


# ---- safety: the banker's check (Dijkstra), one resource: a device's memory ----

@dataclass(frozen=True)
class Claim:
    """A container in the banker's check. `held` is what cannot be taken from it now; it can
    finish (run, then exit and give everything back) once it may hold its whole `limit`.
    stuck: it cannot finish whatever it gets (over its limit: it waits for an operator), so it
    keeps `held` for good."""
    id: str
    limit: int
    held: int
    stuck: bool = False


def finishers(claims: Sequence[Claim], capacity: int) -> list[str]:
    """The containers that can reach their limits one after another on `capacity`, in such an
    order (the banker's algorithm). One resource, so the order by missing memory (limit - held,
    least first) is as good as any: a container that finishes only adds to what is free, so if
    the one missing least cannot go on, nobody can."""
    free = capacity - sum(c.held for c in claims)
    order = []
    for c in sorted((c for c in claims if not c.stuck), key=lambda c: (c.limit - c.held, c.id)):
        if c.limit - c.held > free:
            break
        free += c.held
        order.append(c.id)
    return order


def safe(claims: Sequence[Claim], capacity: int) -> bool:
    """Some order exists in which every container can reach its limit (none is stuck)."""
    return len(finishers(claims, capacity)) == len(claims)


def safe_assignment(me: Claim, others: Sequence[Claim], capacity: int, low: int,
                    high: int) -> int | None:
    """The largest assignment A in [low, high] with which container `me` may *run* (hold A,
    since a running container allocates up to its assignment without asking) and leave the
    state safe: `me` and every container that could finish before (`me` as it is now,
    holding `me.held`) can still finish. None if even `low` (what it needs to run at all) is
    not. A safe state stays safe with less: a smaller A leaves more for the others before `me`
    finishes and nothing changes after (whether `me` itself can go on does not depend on A), so
    the largest safe A is found by bisection.
    "Could finish before" rather than "all": where the state is already unsafe for a reason
    no policy chose (a container over its limit, a limit raised at run time, a context measured
    larger than charged), the moves that make it no worse stay open."""
    if low > high:
        return None
    rest = [c for c in others if c.id != me.id]
    need = set(finishers([*rest, me], capacity)) | {me.id}

    def ok(a: int) -> bool:
        return need <= set(finishers([*rest, Claim(me.id, me.limit, max(a, me.held))], capacity))

    if ok(high):
        return high
    if not ok(low):
        return None
    while high - low > 1:   # ok(low), not ok(high)
        mid = (low + high) // 2
        low, high = (mid, high) if ok(mid) else (low, mid)
    return low


def schedule(policy: str, waiters: Sequence[Waiter], free: int, now: float,
             rng: random.Random, max_wait: float = MAX_WAIT, fit_only: bool = False,
             others: Sequence[Claim] = (), capacity: int | None = None) -> list[Grant]:
    """Hand `free` bytes to waiters, one pick at a time, each up to its full limit.
    fit_only, the pass after a reclaim: the policy picks only among waiters that can resume on
    what is free, and nobody gets a partial slice (else ru would hand the reclaimed pool to a
    waiter it cannot complete, and the deadlock would be back at once).

    Safety (no policy can deadlock): the policy picks only among safe moves. `others` are the
    device's containers that are not waiting (Claim(held=max(assigned, used))), and those
    stuck over their limits; `capacity` the device's (default: `free` plus every assignment
    and every other's hold, as when `free` is all that is unassigned). What counts as held:
      - a running container: its whole assignment (it may allocate up to it without asking);
      - a waiter: only what it uses (`Waiter.held`: bytes and contexts), not the rest of its
        assignment: a paused container's unused assignment can be taken back (`reclaim`).
    So a grant that leaves a waiter paused (less than its pending request) changes nothing the
    check sees and stays allowed (the paper's partial grant); a grant that resumes it is a
    move to "running with A + amount", allowed only if the state stays safe, and else with
    the largest amount that does (`safe_assignment`, at least its request: it resumes on less
    than its limit, as a placement can). A waiter with no safe move is passed over this pass:
    the policy's next choice is asked (fifo, bf, ru and bfa are fixed preference orders over
    the candidates, so this is their choice among the safe moves); rand draws once among the
    safe moves. With the state
    safe before every move, it is safe always (a stall or an exit only adds to what is free),
    and when every container on a device waits, the reclaim plus a fit_only pass can always
    resume one (the first of the banker's order misses at most what is then free): no
    deadlock."""
    fn = _check(policy, max_wait)
    fits = (lambda c: c.need <= free) if fit_only else (lambda c: True)
    candidates = [w for w in waiters if w.missing > 0 and fits(w)]
    state = {c.id: c for c in others}
    state.update((w.id, Claim(w.id, w.limit, w.holds)) for w in waiters)
    if capacity is None:
        capacity = free + sum(w.assigned for w in waiters) + sum(c.held for c in others)
    grants: list[Grant] = []

    def move(w: Waiter) -> int | None:
        """The bytes w may get now: all it can use, cut to what is safe; None: no safe move."""
        amount = min(w.missing, free)
        if w.need > amount:   # stays paused: nothing the check counts changes
            return amount
        top = safe_assignment(state[w.id], list(state.values()), capacity,
                              w.assigned + w.need, w.assigned + amount)
        return None if top is None else top - w.assigned

    while free > 0 and candidates:
        if fn is rand:   # one draw, among the safe moves only: a pass that can grant nothing
            pool = [c for c in candidates if move(c) is not None]   # draws nothing (the daemon
        else:            # passes more often than the simulator: same seed, same draws)
            pool = list(candidates)
        while pool:
            w = fn(pool, free, now, rng, max_wait)
            amount = move(w)
            if amount is not None:
                break
            pool = [c for c in pool if c is not w]
        else:
            break   # no waiter has a safe move on what is free
        if w.need <= amount:
            state[w.id] = Claim(w.id, w.limit, max(w.assigned + amount, w.holds))
        grants.append(Grant(w.id, amount, resume=w.need <= amount))
        free -= amount
        # By identity: two equal waiters (same fields) are still two candidates.
        candidates = [c for c in candidates if c is not w and fits(c)]
    return grants


def assign_new(limit: int, unassigned: int, others: Sequence[Claim] | None = None,
               capacity: int | None = None, held: int = 0, demand: int = 0,
               id: str = "\0new") -> int:
    """Assignment for a container seen for the first time on a device: its limit if the
    capacity not yet assigned allows, else whatever is left (it pauses on reaching that, and
    waits for more). With `others` and `capacity` (the device's other containers, as in
    `schedule`), safely: a container placed with `demand` (what it holds, `held`, plus the call
    it is stopped at) <= A runs at once, so A is cut to the largest assignment that leaves the
    state safe (`safe_assignment`); where even `demand` is not safe it gets 0 and waits,
    holding nothing that could be idle: a later grant resumes it once that is safe. Placed
    with less than its demand it waits anyway and A stays: unused by a waiter, it counts for
    nothing in the check (reclaimable)."""
    a = max(0, min(limit, unassigned))
    if others is None or a < demand:
        return a
    top = safe_assignment(Claim(id, limit, held), others, capacity, max(demand, held), a)
    return 0 if top is None else top


def reclaim(waiting: dict[str, tuple[int, int]], any_running: bool,
            any_within_limit: bool = True) -> dict[str, int]:
    """The deadlock breaker. The paper keeps a partial grant with a paused container; with ru
    and rand (which hand each freed slice to a different waiter) every container can end up
    paused on a slice too small to run on, with nothing left to free anything (the simulator
    finds it in up to a third of runs: docs/SCHEDULING.md). So when no container on a GPU runs
    and a scheduling pass resumed nobody, each paused container's assignment shrinks to what it
    holds, and the pass runs again on the whole pool. When every waiter is over its limit
    nobody could use what comes back, so assignments stay as they are (an operator reading
    `convgpu status` sees the container keep what it was given until its limit is raised).
    With the banker's check (`schedule`) this is what makes a waiter's unused assignment
    reclaimable: the check counts a waiter's held bytes only, and this turns its assignment
    back into exactly that when everyone on the device waits.
    waiting: id -> (assigned, held now); returns id -> new assignment, for those that shrink."""
    if any_running or not any_within_limit:
        return {}
    return {i: held for i, (assigned, held) in waiting.items() if assigned > held}
