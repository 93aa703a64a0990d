"""The driver's count is the last word (issue 39 part 1; STYLE.md 20).

BPF admits every call convgpu knows before it runs. Memory obtained any other way (a stack
limit that takes 17 GiB, a graph's memory node, a module's static data, a call of a driver
newer than the probes) shows only in the driver's own count, which NVML reads per process. So
each NVML sample (the sampler's thread, every SAMPLE_EVERY) is checked here, in the loop: a
container whose processes hold more on a GPU than its limit there is over it, however the
memory was obtained. Then every process of it is stopped (the stall backend in force), or
with --over-limit kill its processes are killed, the one holding most beyond what the probes
account for first, until it fits; one line names the container, the GPU, the gap and the
calls it made. It is resumed only once it fits again (a raised limit, or memory it freed: a
process of it exited or was killed). Meanwhile that memory counts against the GPU's capacity
(books.committed). A process that holds memory and was never placed (no admitted call) is
placed by what it holds (Backstop is handed place()).

Where NVML gives no per-process figures (MIG mode; some vGPUs) the backstop is off for that
GPU, and `status` and `doctor` say why. Where NVML stops answering, nothing stopped here is
resumed until a sample says it fits (fail closed).

The decision is a pure function (overs); Backstop keeps what it stopped and acts."""
import logging
import os
import signal
import time
from dataclasses import dataclass, field

from ..units import format_size
from .failsafe.stall import SignalStopper, Target, _stat

log = logging.getLogger(__package__ + ".daemon")   # the Enforcer logs as one
# s between NVML samples while enforcing: a stop within 1 s of the memory. CONVGPU_SAMPLE_EVERY:
# bench.backstop_cost's knob (what 0.25 s costs against 1 s), read once
SAMPLE_EVERY = float(os.environ.get("CONVGPU_SAMPLE_EVERY", "0.25"))
# The one overshoot the books allow by design: a free settled at its entry while the driver
# still holds the block, with a sibling's allocation admitted into its room (docs/ENFORCE.md,
# issue 32), at most 2 MiB for microseconds. A sample at that instant is not a finding.
SLACK = 2 << 20


def overs(members: dict[int, set[int]], raw: dict[tuple[int, int], int], limit) -> dict[tuple[int, int], tuple[int, int]]:
    """(container key, GPU) -> (NVML's bytes for its processes, its limit there), for each
    container whose processes NVML counts above its limit by more than SLACK. members: key ->
    pids; raw: (pid, GPU) -> NVML's bytes; limit(key, GPU) -> bytes."""
    held: dict[tuple[int, int], int] = {}
    owner = {pid: key for key, pids in members.items() for pid in pids}
    for (pid, dev), n in raw.items():
        key = owner.get(pid)
        if key is not None:
            held[(key, dev)] = held.get((key, dev), 0) + n
    out = {}
    for (key, dev), n in held.items():
        cap = limit(key, dev)
        if cap is not None and n > cap + SLACK:
            out[(key, dev)] = (n, cap)
    return out


@dataclass
class Over:
    """One container over its limit on one GPU, by the driver's count."""
    since: float
    nvml: int
    limit: int
    stopped: dict[int, int] = field(default_factory=dict)   # pid -> its start time, stopped by us
    killed: list[int] = field(default_factory=list)
    frozen: str = ""                                        # its cgroup, where the freezer holds it

    @property
    def gap(self) -> int:
        return self.nvml - self.limit


class Backstop:
    """Handed what it touches: the books (containers, limits), the stall backend, and the
    enforcer's own acts it may ask for (place a process, kill one, whether a pid waits at a
    call BPF stopped, which pids are the enforcer's own children, the calls a process made)."""

    def __init__(self, books, stopper, place, kill, waits_whole, exempt, calls, accounted, over_limit):
        self.books, self.stopper = books, stopper
        self.place, self.kill, self.waits_whole, self.exempt, self.calls = place, kill, waits_whole, exempt, calls
        self.accounted = accounted          # () -> (pid, GPU) -> bytes the probes account for
        self.over_limit = over_limit        # () -> "stall" | "kill" (a reload may change it)
        self.over: dict[tuple[int, int], Over] = {}
        self.off: dict[int, str] = {}       # GPU -> why NVML cannot count its processes
        self.seq = -1                       # the last sample looked at
        self._unplaceable: dict[int, int] = {}   # pid -> start time: no container (the host's, gone)

    def step(self, raw: dict[tuple[int, int], int], seq: int, now: float | None = None,
             compute: set[int] | None = None) -> bool:
        """One NVML sample (seq: the sampler's count; an old one is not looked at twice;
        compute: the pids NVML lists as compute processes, None: all). True if a container was
        stopped, killed or resumed."""
        if seq == self.seq:
            return False
        self.seq, now = seq, now if now is not None else time.monotonic()
        raw = {k: n for k, n in raw.items() if k[1] not in self.off and n > 0}
        self._place_strays({k: n for k, n in raw.items() if compute is None or k[0] in compute})
        boxes = {b.key: b for b in self.books.boxes.values()}
        found = overs({k: b.pids for k, b in boxes.items()}, raw,
                      lambda key, dev: self.books.limit(boxes[key], dev))
        changed = False
        for k in list(self.over):
            if k not in found or k[0] not in boxes:
                changed |= self._fits(self.over.pop(k), boxes.get(k[0]), k[1], raw)
        for (key, dev), (nvml, cap) in found.items():
            o = self.over.get((key, dev))
            if o is None:
                o = self.over[(key, dev)] = Over(now, nvml, cap)
                self._say(boxes[key], dev, o, raw)
            o.nvml, o.limit = nvml, cap
            changed |= self._act(boxes[key], dev, o, raw)
        return changed

    def _place_strays(self, raw):
        """A process NVML counts memory for that no container holds: it never made an admitted
        call (a green context, a call of a driver newer than the probes). Placed by what it
        holds; the enforcer's own children, processes of no container and graphics processes
        (a display server: the caller passes compute processes only) are left out."""
        known = {p for b in self.books.boxes.values() for p in b.pids} | self.exempt()
        for pid in sorted({pid for pid, _ in raw} - known):
            st = _stat(pid, "/proc")
            if st is None or st[0] in "ZXx" or self._unplaceable.get(pid) == st[1]:
                continue
            if self.place(pid) is None:
                self._unplaceable[pid] = st[1]
        if len(self._unplaceable) > 4096:   # pids of processes long gone
            self._unplaceable = {p: s for p, s in self._unplaceable.items() if _stat(p, "/proc") is not None}

    def _say(self, box, dev: int, o: Over, raw):
        act = ("its processes are killed, the one holding most beyond its allocations first"
               if self.over_limit() == "kill" else "every process of it is stopped until it fits")
        calls = "; ".join(f"pid {p}: {self.calls(p, dev)}" for p in sorted(box.pids) if (p, dev) in raw)
        log.warning("container %s GPU%d: over its limit by the driver's count: NVML %s for its processes, limit %s "
                    "(%s over), memory no admitted call explains (%s); %s", box.name, dev, format_size(o.nvml),
                    format_size(o.limit), format_size(o.gap), calls or "no process listed", act)
        box.over_limits += 1

    def _act(self, box, dev: int, o: Over, raw) -> bool:
        if self.over_limit() == "kill":
            return self._kill_until_fits(box, dev, o, raw)
        running = [p for p in sorted(box.pids) if self._runs(p)]
        if not running:
            return False
        if o.stopped and any(p in o.stopped for p in running):
            log.warning("container %s GPU%d: pids %s run again while over its limit (SIGCONT from outside?): "
                        "stopped again", box.name, dev, sorted(p for p in running if p in o.stopped))
        for p in running:
            st = _stat(p, "/proc")
            if st is not None:
                o.stopped[p] = st[1]
        if isinstance(self.stopper, SignalStopper):
            for p in running:
                _signal(p, signal.SIGSTOP)
        else:
            try:
                self.stopper.stall(Target(tuple(box.pids), box.container.cgroup))
                o.frozen = self.stopper.root.rstrip("/") + box.container.cgroup
            except Exception as e:   # a freezer that fails: signal-stopped, said once per pass
                log.warning("container %s: freezer failed (%s); it stays signal-stopped", box.name, e)
                for p in running:
                    _signal(p, signal.SIGSTOP)
        return True

    def _kill_until_fits(self, box, dev: int, o: Over, raw) -> bool:
        """--over-limit kill: the process holding most beyond what the probes account for first
        (the one that took the memory), then the next, until the rest fit."""
        left, acted, known = o.nvml, False, self.accounted()
        for pid in sorted((p for p in box.pids if (p, dev) in raw and p not in o.killed),
                          key=lambda p: known.get((p, dev), 0) - raw[(p, dev)]):
            if left <= o.limit + SLACK:
                break
            log.warning("container %s GPU%d: pid %d killed: it holds %s by the driver's count, %s over the "
                        "container's limit", box.name, dev, pid, format_size(raw[(pid, dev)]),
                        format_size(left - o.limit))
            self.kill(pid)
            o.killed.append(pid)
            left -= raw[(pid, dev)]
            acted = True
        return acted

    def _fits(self, o: Over, box, dev: int, raw) -> bool:
        """It fits again (or its container is gone): what we stopped runs again, but a process
        BPF holds at a call (a wait of its own) stays for the decider to resume."""
        if box is None:
            return False
        nvml = sum(raw.get((p, dev), 0) for p in box.pids)
        log.info("container %s GPU%d: fits its limit again by the driver's count (NVML %s, limit %s) after "
                 "%.1f s%s", box.name, dev, format_size(nvml), format_size(self.books.limit(box, dev)),
                 time.monotonic() - o.since, ": resumed" if o.stopped else "")
        if not o.stopped or any(k[0] == box.key for k in self.over):   # still over on another GPU
            return False
        if isinstance(self.stopper, SignalStopper):
            for p, start in o.stopped.items():
                st = _stat(p, "/proc")
                if st is not None and st[1] == start and not self.waits_whole(box, p):
                    _signal(p, signal.SIGCONT)
        elif not box.waiting:   # a wait of its own keeps it frozen (the freezer holds it whole)
            self.stopper.resume(Target(tuple(box.pids), box.container.cgroup))
            for p in box.pids:
                _signal(p, signal.SIGCONT)
        return True

    @staticmethod
    def _runs(pid: int) -> bool:
        """Some thread of pid runs: a process whose main thread a ptrace hold keeps (a wait of
        its own) may still have others running."""
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            return False
        return any((st := _stat(int(t), f"/proc/{pid}/task")) is not None and st[0] not in "TtZXx" for t in tids)

    def held(self) -> tuple[set[int], set[str]]:
        """What the watchdog must resume if the enforcer dies: the pids stopped here (the
        successor's first sample stops them again while they are over)."""
        return {p for o in self.over.values() for p in o.stopped}, {o.frozen for o in self.over.values() if o.frozen}

    def status(self, key: int, dev: int, now: float) -> dict:
        o = self.over.get((key, dev))
        if o is None:
            return {"over_by": 0, "over_s": 0.0, "nvml_used": None}
        return {"over_by": o.gap, "over_s": round(now - o.since, 3), "nvml_used": o.nvml}


def _signal(pid: int, sig: int):
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
