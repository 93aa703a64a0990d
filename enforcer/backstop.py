"""The driver's count is the last word (issue 39 part 1; STYLE.md 20), acted on only where it
names its holder (issue 47; STYLE.md 22).

BPF admits every call convgpu knows before it runs. Memory obtained any other way (a stack
limit that takes 17 GiB, a graph's memory node, a module's static data, a call of a driver
newer than the probes) shows only in the driver's own count, which NVML reads per process. So
each NVML sample (the sampler's thread, every SAMPLE_EVERY) is checked here, in the loop. Who
holds each row is proven first (enforcer/attribution.py): a member's own, memory a gone member
left (its container's, for as long as NVML lists it), a process that shows it holds it (placed
by what it holds), else unattributed: counted against the GPU (books.unattributed), said, never
acted on. A container whose memory on a GPU is above its limit there is over it, however the
memory was obtained. Then every process of it is stopped (the stall backend in force; where
memory its gone members left counts, every process of its cgroup, since the one keeping the
driver's files made no call), or with --over-limit kill its processes are killed, the one
holding most beyond what the probes account for first, then those holding the GPU's files,
until it fits; one line names the container, the GPU, the gap and the calls it made. What is
stopped is in the watchdog's state file before the signal goes out (saved()). It is resumed
only once it fits again (a raised limit, or memory it freed). Meanwhile that memory counts
against the GPU's capacity (books.committed).

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
from .tenants.containers import ENGINE_KINDS

log = logging.getLogger(__package__ + ".daemon")   # the Enforcer logs as one
# s between NVML samples while enforcing: a stop within 1 s of the memory. CONVGPU_SAMPLE_EVERY:
# bench.backstop_cost's knob (what 0.25 s costs against 1 s), read once
SAMPLE_EVERY = float(os.environ.get("CONVGPU_SAMPLE_EVERY", "0.25"))
# The one overshoot the books allow by design: a free settled at its entry while the driver
# still holds the block, with a sibling's allocation admitted into its room (docs/ENFORCE.md,
# issue 32), at most 2 MiB for microseconds. A sample at that instant is not a finding.
SLACK = 2 << 20
# A graphics process is placed only in a container an engine, a pod or `convgpu run` made: one
# of the host or of a system service is a display server or a desktop, counted, never stopped
GRAPHICS_KINDS = ENGINE_KINDS | {"cgroup"}


def overs(held: dict[tuple[str, int], int], limit) -> dict[tuple[str, int], tuple[int, int]]:
    """(container id, GPU) -> (what it holds by the driver's count, its limit there), for each
    container above its limit by more than SLACK. held: (container id, GPU) -> bytes;
    limit(container id, GPU) -> bytes, None: no limit known (not acted on)."""
    out = {}
    for (cid, dev), n in held.items():
        cap = limit(cid, dev)
        if cap is not None and n > cap + SLACK:
            out[(cid, dev)] = (n, cap)
    return out


@dataclass
class Over:
    """One container over its limit on one GPU, by the driver's count."""
    since: float
    nvml: int
    limit: int
    name: str
    cgroups: tuple                                          # its cgroups (a DRA claim's budget: its members')
    stopped: dict[int, int] = field(default_factory=dict)   # pid -> its start time, stopped by us
    killed: list[int] = field(default_factory=list)
    frozen: tuple = ()                                      # its cgroups, where the freezer holds them

    @property
    def gap(self) -> int:
        return self.nvml - self.limit


class Backstop:
    """Handed what it touches: the books (containers, limits, who left; it writes what gone
    members left and what nobody can be shown to hold), the stall backend, the attribution, and
    the enforcer's own acts it may ask for: place a process (Placement.place_stray), kill one,
    whether a pid waits at a call BPF stopped, which pids are the enforcer's own children, the
    calls a process made, what the probes account for, the over-limit mode, container_of(pid),
    procs(cgroup) (every process of a container), saved() (the watchdog's state file, now) and
    write_assign(box, dev) (a container's charge changed)."""

    def __init__(self, books, stopper, attribution, place, kill, waits_whole, exempt, calls, accounted,
                 over_limit, container_of, procs, saved, write_assign):
        self.books, self.stopper, self.attribution = books, stopper, attribution
        self.place, self.kill, self.waits_whole, self.exempt, self.calls = place, kill, waits_whole, exempt, calls
        self.accounted = accounted          # () -> (pid, GPU) -> bytes the probes account for
        self.over_limit = over_limit        # () -> "stall" | "kill" (a reload may change it)
        self.container_of, self.procs, self.saved, self.write_assign = container_of, procs, saved, write_assign
        self.over: dict[tuple[str, int], Over] = {}
        self.off: dict[int, str] = {}       # GPU -> why NVML cannot count its processes
        self.seq = -1                       # the last sample looked at
        self.found = None                   # the last sample, attributed (status)
        self._unplaceable: dict[int, int] = {}   # pid -> start time: no container to place it in

    def step(self, raw: dict[tuple[int, int], int], seq: int, now: float | None = None,
             compute: set[int] | None = None, totals: dict[int, int] | None = None) -> bool:
        """One NVML sample (seq: the sampler's count; an old one is not looked at twice;
        compute: the pids NVML lists as compute processes, None: all; totals: GPU -> NVML's
        used). True if a container was stopped, killed or resumed."""
        if seq == self.seq:
            return False
        self.seq, now = seq, now if now is not None else time.monotonic()
        exempt = self.exempt()
        raw = {k: n for k, n in raw.items() if k[1] not in self.off and n > 0 and k[0] not in exempt}
        books = self.books
        found = self.attribution.sample(raw, {p: b.container.id for p, b in books.pid_box.items()},
                                        books.departed, self.accounted,
                                        {d: n for d, n in (totals or {}).items() if d not in self.off}, now)
        extra = self._place_strays(found, compute)
        self.attribution.tell(found)
        self.found = found
        self._publish(found)
        boxes = {b.container.id: b for b in books.boxes.values()}
        over = overs(found.held, lambda cid, dev: self._limit(boxes.get(cid), cid, dev))
        changed = False
        for k in list(self.over):
            if k not in over:
                changed |= self._fits(self.over.pop(k), boxes.get(k[0]), k, found)
        for k, (nvml, cap) in over.items():
            o = self.over.get(k)
            if o is None:
                box = boxes.get(k[0])
                gone = self._gone(k[0])
                o = self.over[k] = Over(now, nvml, cap, box.name if box else gone.name,
                                        box.cgroups if box else gone.cgroups or (gone.container.cgroup,))
                self._say(box, k, o, raw, found)
            o.nvml, o.limit = nvml, cap
            changed |= self._act(boxes.get(k[0]), k, o, raw, found, extra.get(k[0], set()))
        return changed

    def _gone(self, cid: str):
        return next((d for d in self.books.departed.values() if d.container.id == cid), None)

    def _limit(self, box, cid: str, dev: int) -> int | None:
        if box is not None:
            return self.books.limit(box, dev)
        gone = self._gone(cid)
        return gone.limits.get(dev) if gone is not None else None

    def _place_strays(self, found, compute) -> dict[str, set[int]]:
        """Each process that proved it holds its row joins its container (a graphics process only
        one of GRAPHICS_KINDS); its row is that container's, placed or not (its container at its
        process quota: container id -> such pids, stopped with it). Rows of processes of no
        container to place them in are unattributed."""
        unplaced: dict[str, set[int]] = {}
        for (pid, dev), n in sorted(found.strays.items()):
            st = _stat(pid, "/proc")
            if st is None:
                continue
            try:
                c = self.container_of(pid)
            except Exception:
                c = None
            graphics = compute is not None and pid not in compute
            why = ("no container" if c is None else
                   f"a graphics process of {c.kind} {c.id}, not of a container (a display server)"
                   if graphics and c.kind not in GRAPHICS_KINDS else "")
            box = self.books.pid_box.get(pid)
            if not why and box is None and self._unplaceable.get(pid) != st[1]:
                box = self.place(pid, dev)
                if box is None:
                    self._unplaceable[pid] = st[1]
            owner = None if why else box or self.books.member_box(c.id) or self.books.boxes.get(c.id)
            if owner is None:
                found.add(found.unattributed, dev, n)
                found.why[(pid, dev)] = why or "no container could take it"
                continue
            found.add(found.held, (owner.container.id, dev), n)   # its budget's (a claim's: shared)
            if box is None:
                unplaced.setdefault(owner.container.id, set()).add(pid)
        if len(self._unplaceable) > 4096:   # pids of processes long gone
            self._unplaceable = {p: s for p, s in self._unplaceable.items() if _stat(p, "/proc") is not None}
        return unplaced

    def _publish(self, found):
        """What gone members left, per container, and what nobody holds, per GPU, into the books
        (Books.held, committed and room read them); a container whose charge moved is written
        to BPF at once, so its next call is admitted against it."""
        books, old = self.books, self.books.orphaned
        books.orphaned, books.unattributed = found.left, dict(found.unattributed)
        for box in books.boxes.values():
            cid = box.container.id
            for dev in box.assigned:
                if old.get(cid, {}).get(dev, 0) != found.left.get(cid, {}).get(dev, 0):
                    self.write_assign(box, dev)

    def _say(self, box, k, o: Over, raw, found):
        cid, dev = k
        act = ("its processes are killed, the one holding most beyond its allocations first"
               if self.over_limit() == "kill" else "every process of it is stopped until it fits")
        calls = "; ".join(f"pid {p}: {self.calls(p, dev)}" for p in sorted(box.pids) if (p, dev) in raw) if box else ""
        left = found.left.get(cid, {}).get(dev, 0)
        if left:
            gone = sorted(p for p, d in self.books.departed.items() if d.container.id == cid and (p, dev) in raw)
            calls = "; ".join(x for x in (calls, f"{format_size(left)} left by its processes that exited "
                                          f"(pids {', '.join(map(str, gone))}): another process keeps the "
                                          f"driver's files") if x)
        log.warning("container %s GPU%d: over its limit by the driver's count: NVML %s for its processes, limit %s "
                    "(%s over), memory no admitted call explains (%s); %s", o.name, dev, format_size(o.nvml),
                    format_size(o.limit), format_size(o.gap), calls or "no process listed", act)
        if box is not None:
            box.over_limits += 1

    def _targets(self, box, cid: str, dev: int, found, unplaced: set[int]) -> set[int]:
        """Who is stopped (or killed) for it: its placed processes, those of its strays that could
        not be placed, and where memory its gone members left counts, every process of its
        cgroup (the one that keeps the driver's files made no call)."""
        pids = set(box.pids) if box is not None else set()
        if found.left.get(cid, {}).get(dev) or box is None:
            gone = self._gone(cid)
            cgs = box.cgroups if box is not None else gone.cgroups or (gone.container.cgroup,) if gone else ()
            for cg in cgs:
                if cg and cg != "/":   # never the host's every process
                    pids |= self.procs(cg)
        return (pids | unplaced) - self.exempt() - {os.getpid()}

    def _act(self, box, k, o: Over, raw, found, unplaced: set[int]) -> bool:
        cid, dev = k
        targets = self._targets(box, cid, dev, found, unplaced)
        if self.over_limit() == "kill":
            return self._kill_until_fits(box, k, o, raw, targets)
        running = [p for p in sorted(targets) if self._runs(p)]
        if not running:
            return False
        if o.stopped and any(p in o.stopped for p in running):
            log.warning("container %s GPU%d: pids %s run again while over its limit (SIGCONT from outside?): "
                        "stopped again", o.name, dev, sorted(p for p in running if p in o.stopped))
        for p in running:
            st = _stat(p, "/proc")
            if st is not None:
                o.stopped[p] = st[1]
        freezer = not isinstance(self.stopper, SignalStopper)
        if freezer:
            o.frozen = tuple(self.stopper.root.rstrip("/") + cg for cg in o.cgroups)
        self.saved()   # the watchdog resumes them if we die from here on (before the stop: issue 47)
        if freezer:
            try:
                for cg in o.cgroups:
                    self.stopper.stall(Target(tuple(running), cg))
                return True
            except Exception as e:   # a freezer that fails: signal-stopped, said once per pass
                log.warning("container %s: freezer failed (%s); it stays signal-stopped", o.name, e)
        for p in running:
            _signal(p, signal.SIGSTOP)
        return True

    def _kill_until_fits(self, box, k, o: Over, raw, targets: set[int]) -> bool:
        """--over-limit kill: the process holding most beyond what the probes account for first
        (the one that took the memory), then the next; then, where memory its gone members left
        keeps it over, the processes of it that hold the GPU's files (which keep that memory)."""
        cid, dev = k
        left, acted, known = o.nvml, False, self.accounted()
        listed = sorted((p for p in targets if (p, dev) in raw and p not in o.killed),
                        key=lambda p: known.get((p, dev), 0) - raw[(p, dev)])
        holders = sorted(p for p in targets - set(listed) if p not in o.killed and self.attribution.proof.holds(p, dev))
        for pid in listed + holders:
            if left <= o.limit + SLACK:
                break
            n = raw.get((pid, dev), 0)
            log.warning("container %s GPU%d: pid %d killed: it holds %s by the driver's count%s, %s over the "
                        "container's limit", o.name, dev, pid, format_size(n),
                        "" if n else " and the GPU's files its gone processes' memory hangs on",
                        format_size(left - o.limit))
            self.kill(pid)
            o.killed.append(pid)
            left -= n
            acted = True
        return acted

    def _fits(self, o: Over, box, k, found) -> bool:
        """It fits again (or its memory is gone): what we stopped runs again, but a process BPF
        holds at a call (a wait of its own) stays for the decider to resume."""
        cid, dev = k
        log.info("container %s GPU%d: fits its limit again by the driver's count (NVML %s, limit %s) after "
                 "%.1f s%s", o.name, dev, format_size(found.held.get(k, 0)), format_size(o.limit),
                 time.monotonic() - o.since, ": resumed" if o.stopped else "")
        if not o.stopped or any(x[0] == cid for x in self.over):   # still over on another GPU
            return False
        if isinstance(self.stopper, SignalStopper):
            for p, start in o.stopped.items():
                st = _stat(p, "/proc")
                if st is not None and st[1] == start and not (box is not None and self.waits_whole(box, p)):
                    _signal(p, signal.SIGCONT)
        elif box is None or not box.waiting:   # a wait of its own keeps it frozen (the freezer holds it whole)
            for cg in o.cgroups:
                self.stopper.resume(Target(tuple(o.stopped), cg))
            for p, start in o.stopped.items():
                st = _stat(p, "/proc")
                if st is not None and st[1] == start:
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
        return {p for o in self.over.values() for p in o.stopped}, {cg for o in self.over.values() for cg in o.frozen}

    def status(self, cid: str, dev: int, now: float) -> dict:
        o = self.over.get((cid, dev))
        left = self.books.orphaned.get(cid, {}).get(dev, 0)
        if o is None:
            return {"over_by": 0, "over_s": 0.0, "nvml_used": None, "left_by_exited": left}
        return {"over_by": o.gap, "over_s": round(now - o.since, 3), "nvml_used": o.nvml, "left_by_exited": left}

    def gone_rows(self, now: float) -> list[dict]:
        """Containers with no process placed that hold memory their gone members left (status)."""
        boxes = {b.container.id for b in self.books.boxes.values()}
        out = []
        for cid, per in sorted(self.books.orphaned.items()):
            if cid in boxes:
                continue
            gone = self._gone(cid)
            for dev, n in sorted(per.items()):
                out.append({"id": cid, "name": gone.name if gone else cid, "gpu": dev, "bytes": n,
                            "pids": sorted(p for p, d in self.books.departed.items() if d.container.id == cid),
                            **{k: v for k, v in self.status(cid, dev, now).items() if k != "left_by_exited"}})
        return out


def _signal(pid: int, sig: int):
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
