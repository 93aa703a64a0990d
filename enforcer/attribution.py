"""Who holds what the driver counts (issue 47; STYLE.md 22: identity is proven, never inferred).

NVML lists GPU memory by bare pid, and a pid is a number the kernel hands out again (pid_max is
32,768 on some hosts). Memory can outlive its process (another process keeps the driver's files:
descriptors passed over a unix socket), stay listed under the dead pid, and that pid can by then
name a process of another tenant or of the host. Taking the row's pid for its holder let one
tenant get another stopped or killed. So the backstop acts on a process only where it can show
that the process holds the memory, and a row's bytes go to whoever can be shown to hold them:
- a member (a process placed by its own admitted call: BPF named it, at its first call) holds
  its row;
- a departed member (its exit seen by the probes, its container remembered by the books) holds
  what NVML still lists under its pid once its exit settled (its pidfd fired) and DEPARTED_GRACE
  passed (NVML lists a process's memory for a short while after its exit: FACTS.md): memory
  that outlived it, charged to its container for as long as NVML lists it. Where its pid names
  a new member since, the new one holds what the probes account for it, the departed the rest;
- any other pid holds its row only if it proves it: a process (a thread id resolves in /proc
  too), alive, with this GPU's device node open (the files the driver's memory hangs on,
  probes/gpumap.py `opened_minors`: read from the kernel, never a path in its mount namespace)
  and started before NVML first listed the row. It is then placed by what it holds;
- the rest is unattributed: counted against the GPU's capacity, shown, said once, charged to no one.
The GPU's own total (NVML's used) less every row and less the driver's floor (the least seen, as
the smaller of two samples in a row) is memory no row names: unattributed too.
Pure but for the /proc reads of Proof (handed in: tests give fakes)."""
import logging
import os
import time
from dataclasses import dataclass, field

from ..probes import gpumap
from .failsafe.stall import _stat

log = logging.getLogger(__package__ + ".daemon")   # the Enforcer logs as one
DEPARTED_GRACE = 0.5     # s after a member's exit settled before NVML's row for it is memory it left
DEPARTED_MAX = 4096      # gone members remembered at most (the oldest settled go first)
CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass
class Departed:
    """A member whose exit the probes saw: its container keeps what NVML still lists under its pid."""
    container: object        # tenants.containers.Container
    name: str
    limits: dict[int, int]   # its container's limit per GPU when it left
    at: float                # when it left (monotonic)
    settled: float = 0.0     # when the driver could have freed its memory (its pidfd fired); 0: not yet
    cgroups: tuple = ()      # its container's cgroups (a DRA claim's budget: every member's)


@dataclass
class Found:
    """One sample, attributed. held: (container id, GPU) -> bytes of its members and departed;
    left: container id -> {GPU: bytes its departed members left}; strays: (pid, GPU) -> bytes of
    processes that proved themselves (to be placed); unattributed: GPU -> bytes; why: (pid, GPU)
    -> why a row is unattributed."""
    held: dict = field(default_factory=dict)
    left: dict = field(default_factory=dict)
    strays: dict = field(default_factory=dict)
    unattributed: dict = field(default_factory=dict)
    why: dict = field(default_factory=dict)

    def add(self, table: dict, key, n: int):
        table[key] = table.get(key, 0) + n


class Proof:
    """What the kernel says of a listed pid (hostile: its /proc is read capped, FUSE never
    touched). minors: GPU -> its /dev/nvidiaN minor (NVML), -1 unknown; opened(pid, major):
    the minors of the NVIDIA nodes pid holds open (probes/gpumap.py; tests hand a fake)."""

    def __init__(self, minors: dict[int, int], major: int | None = None, proc: str = "/proc",
                 opened=gpumap.opened_minors):
        self.minors, self.proc, self.opened = minors, proc, opened
        self.major = major if major is not None else gpumap.nvidia_major()

    def start(self, pid: int) -> int | None:
        """Its start time (clock ticks since boot) if pid is a live process (not a thread of one,
        not a zombie), else None."""
        st = _stat(pid, self.proc)
        if st is None or st[0] in "ZXx" or not self._leader(pid):
            return None
        return st[1]

    def _leader(self, pid: int) -> bool:
        try:
            with open(f"{self.proc}/{int(pid)}/status", "rb") as f:
                text = f.read(8192)
        except OSError:
            return False
        line = next((x for x in text.splitlines() if x.startswith(b"Tgid:")), b"")
        return line.split()[1:2] == [str(pid).encode()]

    def holds(self, pid: int, dev: int) -> bool:
        """pid has GPU dev's device node open (any NVIDIA node where NVML gives no minor)."""
        got = self.opened(pid, self.major)
        want = self.minors.get(dev, -1)
        return bool(got) and (want < 0 or want in got)


def boottime() -> float:
    return time.clock_gettime(time.CLOCK_BOOTTIME)


class Attribution:
    """Per sample, who holds each row (Found). Keeps when each row was first listed, the GPUs'
    floors and what it said."""

    def __init__(self, proof: Proof, clock=boottime):
        self.proof, self.clock = proof, clock
        self.first: dict[tuple[int, int], float] = {}    # (pid, GPU) -> listed since (boot time, s)
        self.floor: dict[int, int] = {}                  # GPU -> the least of its total not in rows
        self._extra: dict[int, int] = {}                 # GPU -> the last sample's, for two in a row
        self.said: dict[tuple[int, int], str] = {}       # (pid, GPU) -> the reason said for it

    def sample(self, rows: dict[tuple[int, int], int], members: dict[int, str], departed: dict[int, Departed],
               accounted, totals: dict[int, int] | None = None, now: float | None = None) -> Found:
        """rows: (pid, GPU) -> bytes (NVML's, the backstop's GPUs); members: pid -> its container's
        id; departed: the books' (pruned here: a settled one NVML no longer lists is forgotten);
        accounted(): (pid, GPU) -> what the probes account for (read only where a pid is both a
        member and departed); totals: GPU -> NVML's used."""
        now = time.monotonic() if now is None else now
        boot = self.clock()
        self.first = {k: self.first.get(k, boot) for k in rows}
        found, known = Found(), None
        for (pid, dev), n in sorted(rows.items()):
            gone = departed.get(pid)
            # settled: the driver could free it and has had DEPARTED_GRACE to; before, its exit
            # holds it (books.Exit) or the driver is tearing it down: not a finding
            settled = gone is not None and gone.settled and now - gone.settled >= DEPARTED_GRACE
            if pid in members:
                mine = n
                if gone is not None:   # a reused pid: the new member holds what it is known to
                    known = accounted() if known is None else known
                    mine = min(n, known.get((pid, dev), 0))
                found.add(found.held, (members[pid], dev), mine)
                n -= mine
            if gone is not None or n <= 0:
                if settled and n > 0:
                    cid = gone.container.id
                    found.add(found.held, (cid, dev), n)
                    found.add(found.left.setdefault(cid, {}), dev, n)
                continue
            why = self._proves(pid, dev)
            if why:
                found.add(found.unattributed, dev, n)
                found.why[(pid, dev)] = why
            else:
                found.strays[(pid, dev)] = n
        self._forget(rows, departed, now)
        self._unnamed(rows, totals or {}, found)
        return found

    def _proves(self, pid: int, dev: int) -> str:
        """"" if pid shows it holds its row on dev, else why not."""
        start = self.proof.start(pid)
        if start is None:
            return "no live process of that pid (gone, a zombie, or a thread id)"
        if start / CLK_TCK > self.first[(pid, dev)]:
            return "the process of that pid started after NVML listed the memory (a reused pid)"
        if not self.proof.holds(pid, dev):
            return "the process of that pid has no device node of the GPU open"
        return ""

    def _forget(self, rows, departed: dict[int, Departed], now: float):
        listed = {pid for pid, _ in rows}
        for pid in [p for p, d in departed.items() if d.settled and now - d.settled >= DEPARTED_GRACE
                    and p not in listed]:
            del departed[pid]
        self.said = {k: v for k, v in self.said.items() if k in rows}

    def _unnamed(self, rows, totals: dict[int, int], found: Found):
        """Each GPU's total less its rows, less its floor: memory NVML names no process for. A
        transient (a row read a moment before the total) is not a finding: the smaller of two
        samples in a row counts."""
        for dev, total in totals.items():
            extra = max(0, total - sum(n for (_, d), n in rows.items() if d == dev))
            floor = self.floor[dev] = min(self.floor.get(dev, extra), extra)
            steady = min(extra, self._extra.get(dev, extra))
            self._extra[dev] = extra
            if steady > floor:
                found.add(found.unattributed, dev, steady - floor)

    def tell(self, found: Found):
        """One line per row newly unattributed (per reason), as it is found."""
        for (pid, dev), why in found.why.items():
            if self.said.get((pid, dev)) != why:
                self.said[(pid, dev)] = why
                log.warning("GPU%d: pid %d is listed by NVML with memory convgpu cannot attribute: %s; "
                            "counted against the GPU, charged to no one and never stopped", dev, pid, why)


def remember(books, pid: int, box) -> None:
    """Exits: a member left; its container keeps what NVML may still list under its pid."""
    books.departed[pid] = Departed(box.container, box.name, {d: books.limit(box, d) for d in box.assigned},
                                   time.monotonic(), cgroups=box.cgroups)
    if len(books.departed) > DEPARTED_MAX:   # the oldest settled first (a flood of exits is bounded)
        order = sorted(books.departed, key=lambda p: (not books.departed[p].settled, books.departed[p].at))
        for p in order[:len(books.departed) - DEPARTED_MAX]:
            del books.departed[p]
