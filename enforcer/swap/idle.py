"""Whom to swap out, and when a process is idle (issue 46): pure functions over plain values,
tested without a kernel (tests/unit/test_swap_idle.py).

Idle, for --swap-idle SECONDS, is evidence of three kinds, each of which must be quiet for that
long: the probes' counters of the process's driver calls (allocations, frees, contexts), its CPU
time (a process that launches kernels or copies spends CPU on it: the probes do not see
launches, whose trap would cost every launch on the host), and, where NVML gives it, its share
of the GPU's SMs. A process blocked in a long kernel with blocking sync may look idle by the
first two: NVML's utilization catches it where it is given, and the driver's lock then waits
for work in flight (its timeout: the swap fails and says so, and the process runs on)."""
from dataclasses import dataclass

CPU_QUIET = 0.01   # of one CPU: a sleeping Python's timers and GC stay well below it


@dataclass
class Activity:
    """What one process looked like at its last sample, and since when it has been quiet."""
    calls: int           # the probes' count of its driver calls (allocations, frees, contexts)
    cpu_ticks: int       # utime + stime (/proc/PID/stat, clock ticks)
    at: float            # when sampled
    quiet_since: float   # the last time any of the three moved


def observe(prev: Activity | None, calls: int, cpu_ticks: int, busy_gpu: bool, now: float,
            ticks_per_s: int = 100) -> Activity:
    """The next sample. Quiet goes on while calls did not change, the CPU time grew by less than
    CPU_QUIET of the time between the samples, and NVML saw no SM use."""
    if prev is None:
        return Activity(calls, cpu_ticks, now, now)
    cpu = (cpu_ticks - prev.cpu_ticks) / ticks_per_s
    quiet = calls == prev.calls and cpu <= CPU_QUIET * max(now - prev.at, 1e-3) and not busy_gpu
    return Activity(calls, cpu_ticks, now, prev.quiet_since if quiet else now)


@dataclass(frozen=True)
class Holder:
    """A process that holds memory on the GPU in question."""
    pid: int
    container: str
    footprint: int       # what leaves the GPU if it is swapped out (NVML's figure for it)
    idle_s: float        # how long it has been quiet
    why_not: str = ""    # why it may not be swapped ("" if it may)


def victims(holders: list[Holder], need: int, idle_s: float) -> list[Holder]:
    """Holders to swap out so that `need` bytes free: those idle at least idle_s that may be
    swapped, idle longest first, until their footprints cover need; none if they cannot."""
    ok = sorted((h for h in holders if not h.why_not and h.idle_s >= idle_s and h.footprint > 0),
                key=lambda h: (-h.idle_s, h.pid))
    out, got = [], 0
    for h in ok:
        if got >= need:
            break
        out.append(h)
        got += h.footprint
    return out if got >= need else []


def breaker(holders: list[Holder], needs: dict[str, int]) -> list[Holder]:
    """A deadlock (every container on the GPU waits, none can run on what is free): the processes
    of ONE waiting container to swap out, chosen so that another waiter can then run. needs:
    container -> what it lacks to run. The container swapped is the one whose processes, all
    swappable, free at least another's need with the least footprint (the least copied to host
    memory and back), ties to the smaller container name; none where no container can."""
    by: dict[str, list[Holder]] = {}
    for h in holders:
        by.setdefault(h.container, []).append(h)
    best = None
    for c, hs in sorted(by.items()):
        if any(h.why_not for h in hs):
            continue
        total = sum(h.footprint for h in hs)
        if not any(total >= n for other, n in needs.items() if other != c):
            continue
        if best is None or total < best[0]:
            best = (total, hs)
    return sorted(best[1], key=lambda h: h.pid) if best else []
