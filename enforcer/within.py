"""Within one container: which of its stopped calls resume now. Pure, as policies.py is: the
books come in as plain values (each unit's asks, the room, what each process holds), so the
choice is tested without a kernel or an Enforcer (tests/unit/test_within.py); Decider._serve
feeds it and carries the answer out.

A unit is what resumes together: one thread's call, or every stopped call of a process held
whole (ptrace refused: one SIGCONT resumes them all). Its `need` is what it adds to the
container's taken memory (0 for a call whose reservation BPF kept: books.Ask.need)."""
from collections.abc import Callable, Sequence

from .policies import Claim, finishers

Holds = dict[int, tuple[int, int]]   # pid -> (what it holds on the device, of that its contexts)


def newcomer(pid: int, holds: Holds) -> bool:
    """A process that holds nothing but its contexts."""
    held, ctx = holds.get(pid, (0, 0))
    return held <= ctx


def resumable(units: Sequence[list], room: int, spare: int, holds: Holds,
              settling: Callable[[int, int], bool] = lambda pid, room_after: False) -> list[list]:
    """The units that resume now, in the order they go: those of processes that hold memory
    first (finishing them frees it), then by when they stopped. Each must fit `room` (its
    assignment less what the container has taken) after the ones before it. A unit of a
    newcomer goes only where every waiting holder can still finish after it (newcomer_safe,
    on `spare`: its limit less what it has taken). A process's first context asks
    settling(pid, room it would leave) before it goes (Decider._settling: it may wait for
    the newcomer before it). holds is empty where there is one unit: no order to keep."""
    go: list[list] = []
    for unit in sorted(units, key=lambda u: (newcomer(u[0].pid, holds), min(a.since for a in u))):
        size = sum(a.need for a in unit)
        if any(a.over_limit for a in unit) or size > room:
            continue
        if holds and not newcomer_safe(unit, units, go, holds, spare - size - sum(a.need for u in go for a in u)):
            continue
        if any(a.first for a in unit) and settling(unit[0].pid, room - size):
            continue
        go.append(unit)
        room -= size
    return go


def newcomer_safe(unit: list, units: Sequence[list], go: Sequence[list], holds: Holds, spare: int) -> bool:
    """The banker's check over a container's processes, for a unit of a newcomer: after it,
    every waiting process that holds bytes can still reach what it asks for in some order
    within `spare` (the limit less what is taken, after this unit and those going before it),
    each giving back what it holds once done (policies.finishers). Its context must not take
    the room its siblings need to finish: they would wait on each other for good."""
    pid = unit[0].pid
    if not newcomer(pid, holds):
        return True
    started = {u[0].pid for u in go}
    claims = []
    for u in units:
        q = u[0].pid
        if q == pid or q in started or newcomer(q, holds):
            continue
        h = holds[q][0]
        claims.append(Claim(str(q), h + sum(a.size for a in u), h))
    if not claims:
        return True
    return len(finishers(claims, spare + sum(c.held for c in claims))) == len(claims)
