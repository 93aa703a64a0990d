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
    (free <= 0, or every waiter is already at its limit)."""
    fn = _check(policy, max_wait)
    candidates = [w for w in waiters if w.missing > 0]
    if free <= 0 or not candidates:
        return None
    return fn(candidates, free, now, rng, max_wait)


def schedule(policy: str, waiters: Sequence[Waiter], free: int, now: float,
             rng: random.Random, max_wait: float = MAX_WAIT, fit_only: bool = False) -> list[Grant]:
    """Hand `free` bytes to waiters, one pick at a time, each up to its full limit.
    fit_only, the pass after a reclaim: the policy picks only among waiters that can resume on
    what is free, and nobody gets a partial slice (else ru would hand the reclaimed pool to a
    waiter it cannot complete, and the deadlock would be back at once)."""
    fn = _check(policy, max_wait)
    fits = (lambda c: c.need <= free) if fit_only else (lambda c: True)
    candidates = [w for w in waiters if w.missing > 0 and fits(w)]
    grants: list[Grant] = []
    while free > 0 and candidates:
        w = fn(candidates, free, now, rng, max_wait)
        amount = min(w.missing, free)
        grants.append(Grant(w.id, amount, resume=w.need <= amount))
        free -= amount
        # By identity: two equal waiters (same fields) are still two candidates.
        candidates = [c for c in candidates if c is not w and fits(c)]
    return grants


def assign_new(limit: int, unassigned: int) -> int:
    """Assignment for a container seen for the first time: its limit if the capacity not yet
    assigned allows, else whatever is left (it pauses on reaching that, and waits for more)."""
    return max(0, min(limit, unassigned))


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
    waiting: id -> (assigned, held now); returns id -> new assignment, for those that shrink."""
    if any_running or not any_within_limit:
        return {}
    return {i: held for i, (assigned, held) in waiting.items() if assigned > held}
