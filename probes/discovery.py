"""Event-driven discovery, fail closed: a process that opens a file named like the driver is
stopped there by BPF (bpf/discovery.bpf.c) and resumed once that file is probed.

A uprobe belongs to an inode, and a container may bring its own driver copy (CUDA forward
compatibility, an image that bundles the driver, a file on an overlay): found by polling /proc,
such a copy was probed a second or more after the process began calling into it, and what it
allocated meanwhile was never seen. Now the open of the file is the checkpoint: its inode is
opened through /proc/PID/fd/FD (probes/untrusted.py: non-blocking, a regular file or nothing);
a known one resumes the process at once, a new one is queued, read and attached by the loop, a
few per pass (ATTACH_PER_PASS, PASS_BUDGET_S: hundreds of copies opened at once cost bounded
work per pass, issue 24 row 7). A file that cannot be probed is a loud warning, said once per
container and reason (probes/said.py), and the caller's `on_unprobed` decides (trace: let it run;
enforce: --unprobed stall|kill|allow). A file that is not a regular file (a FIFO) cannot be
mapped, so it cannot hold code: its opener is let go at once.

Nothing stays stopped for good, and a hung loop holds nobody: probes/held.py."""
import collections
import contextlib
import ctypes as ct
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass

from . import loader, reading, untrusted
from .held import HELD_NODE, HELD_OPEN, Held  # noqa: F401 (HELD_OPEN: enforcer/actions.py)
from .identity import Identity
from .libs import Library
from .said import container_of
from .table import CUDA
from ..threads import Thread

ATTACH_PER_PASS = 4   # new driver copies attached in one loop pass (one: ~30 links, milliseconds)
PASS_BUDGET_S = 0.5   # and no more attaching once a pass has spent this on it
BEAT_EVERY_S = 0.5
COPIES_PER_CONTAINER = 32   # driver copies probed at once for one container: each costs ~60 links
                            # (descriptors, kernel uprobes); a real one brings one or two
WHAT = {"stall": "kept stopped until it is killed or the enforcer stops", "kill": "killed",
        "allow": "let run UNCHECKED"}

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Unprobed:
    """A process held (or killed, or let run) because its driver file could not be probed."""
    pid: int
    library: str
    reason: str
    action: str      # stall: kept stopped; kill; allow: runs unchecked


def allow(pid: int, lib: Library, reason: str) -> str:
    """`convgpu trace`'s choice: a view never holds a process (Discovery says so, loudly)."""
    return "allow"


@dataclass
class Pending:
    """A new driver copy some process opened: read (off the loop, probes/reading.py) and
    attached by later loop passes, while its openers wait (held)."""
    lib: Library
    keys: list          # pid_tgid of each thread stopped at its open
    read: object = None       # the Future of its reading, once submitted
    container: str | None = None


class Discovery:
    def __init__(self, tracer, on_unprobed=allow):
        self.tracer = tracer
        self.on_unprobed = on_unprobed        # (pid, Library, reason) -> "stall" | "kill" | "allow"
        self.unprobed: dict[int, Unprobed] = {}
        self.enabled = False
        self.stops = 0                         # processes stopped at open, all told
        self.recent = collections.deque(maxlen=1024)   # their pids, latest last
        self.watchdog = None
        self._lifeline = None
        self.pending: dict[tuple, Pending] = {}             # inode -> Pending, in arrival order
        self.openers: dict[tuple, set[int]] = {}            # inode -> pids that opened it
        self.owner: dict[tuple, str] = {}                   # inode -> the container whose open found it
        self.beaten = time.monotonic()
        self._sentinel = None
        self._stop = threading.Event()
        self._exempt = 0
        self.reader = reading.Reader()          # files are read there, never on the loop
        self.identity = Identity(self)          # and processes that open the GPU are checked there
        self.not_code: set[tuple] = set()       # inodes opened by a driver's name that are no ELF
        self.spent = reading.Spent()            # and each container's reading is budgeted
        self.held = Held(lambda: self._map("held"))   # the threads BPF stopped at an open
        self.lost_events = 0                    # stops looked at with no event (ring buffer full)
        self.lost_looks = 0

    def _map(self, name: str):
        return self.tracer.b[name.encode()]

    def _write(self, on: bool, exempt: int = 0):
        t = self._map("discovery")
        t[ct.c_int(0)] = t.Leaf(on=int(on), exempt=exempt, beat_ns=time.monotonic_ns())
        self._exempt = exempt

    def beat(self, force: bool = False):
        """The loop ran: BPF may go on stopping processes at their opens (bpf DISCOVERY_STALE_NS)."""
        now = time.monotonic()
        if self.enabled and (force or now - self.beaten >= BEAT_EVERY_S):
            self.beaten = now
            self._write(True, self._exempt)

    def fail_safe_fds(self) -> tuple[list[int], int]:
        """(maps the watchdog zeroes, the `held` map it empties) if we die."""
        return [self._map("discovery").map_fd], self._map("held").map_fd

    def enable(self, own_watchdog: bool = True):
        """From now on a process that opens a driver file waits for its probes. Without a
        watchdog of the caller's (the enforcer's), one of our own resumes them if we die."""
        from .loader import has_open_tracepoints
        if not has_open_tracepoints():
            log.warning("this kernel has no syscalls tracepoints: a new driver copy is found by the "
                        "periodic scan only, up to a second after its process starts calling it")
            return
        if own_watchdog and self.watchdog is None:
            from ..enforcer.failsafe import watchdog
            zero, held = self.fail_safe_fds()
            self.watchdog, self._lifeline = watchdog.spawn(os.getpid(), "-", zero, held)
        self.enabled = True
        self.beaten = time.monotonic()
        self._write(True)
        self._stop.clear()
        self._sentinel = Thread(target=self.held.watch, args=(lambda: self.beaten, self._stop),
                                name="convgpu-sentinel", daemon=True)
        self._sentinel.start()

    def disable(self):
        """Nobody stays stopped: discovery off, then every held process resumed."""
        if not self.enabled:
            return
        self._write(False)
        self.enabled = False
        self._stop.set()
        if self._sentinel is not None:
            self._sentinel.join(timeout=5)
            self._sentinel = None
        for _ in range(2):     # a program past its check when `on` went to 0 may still stop one
            time.sleep(0.02)   # (a vCPU the host took away mid-program): looked at twice
            for key in self.held.listed():
                self.held.resume(key)
        self.unprobed.clear()
        self.identity.clear()
        for p in self.pending.values():
            self.tracer.let_go(p.lib)
        self.pending.clear()
        if self.watchdog is not None:
            self.watchdog.kill()
            self.watchdog.wait()
            os.close(self._lifeline)
            self.watchdog = None

    @contextlib.contextmanager
    def exempting(self, pid: int):
        """The self-test child opens the library being attached: it must not wait for it."""
        if not self.enabled:
            yield
            return
        self._write(True, exempt=pid)
        try:
            yield
        finally:
            self._write(self.enabled)

    def opened(self, pid: int, tid: int, fd: int):
        """BPF stopped thread tid of pid right after it opened a driver-named file as fd. Only
        our own non-blocking descriptor of that file is looked at (probes/untrusted.py)."""
        key = pid << 32 | tid
        self.stops += 1
        self.recent.append(pid)
        if not self.held.still(key, fd):   # let go meanwhile (a stale loop): fd may be another file now
            return
        try:
            mine = untrusted.open_process_fd(pid, fd)
        except OSError:       # gone already, or closed and reused: nothing to probe
            self.held.resume(key)
            return
        try:
            st = untrusted.check(mine)
        except (untrusted.Refused, OSError) as e:   # a FIFO, a socket...: no code can be mapped from it
            untrusted.close(mine)
            self.tracer.say(logging.WARNING, (container_of(pid), str(e)), "pid %d opened %s: %s; not a driver, "
                     "let go", pid, _seen_as(pid, fd), e)
            self.held.resume(key)
            return
        inode = (st.st_dev, st.st_ino)
        self.openers.setdefault(inode, set()).add(pid)
        if inode in self.pending:
            untrusted.close(mine)
            self.pending[inode].keys.append(key)
            return
        if inode in self.tracer.finder.known:
            untrusted.close(mine)
            self._settle(inode, [key])
            return
        seen_as = _seen_as(pid, fd)
        if st.st_nlink == 0:
            log.info("pid %d opened %s, deleted since: probed through its descriptor", pid, seen_as)
        self.pending[inode] = Pending(Library(CUDA, _shown(pid, seen_as), inode, seen_as, mine), [key])

    def queue(self, lib: Library) -> None:
        """A copy the periodic scan found (a process maps it): attached like an opened one."""
        self.pending.setdefault(lib.inode, Pending(lib, []))

    def work(self) -> int:
        """From the loop, after the pass's events: queued copies are read on the reader thread
        (at most ATTACH_PER_PASS at a time, in arrival order) and attached here once read, at
        most ATTACH_PER_PASS and PASS_BUDGET_S worth a pass; their openers wait meanwhile.
        Every copy read counts toward its container's COPIES_PER_CONTAINER, whatever the
        reading found (issue 33 row 4: failed attaches did not, so one container could make
        the loop read without end). Returns how many were settled."""
        t0 = time.monotonic()
        self.lost()
        looked = self.identity.work()
        n = reading_now = 0
        for inode in list(self.pending):
            if n >= ATTACH_PER_PASS or time.monotonic() - t0 > PASS_BUDGET_S:
                break
            p = self.pending[inode]
            if p.read is None:
                if reading_now >= ATTACH_PER_PASS:
                    continue
                why = self._refuse(p)
                if why is None:
                    p.read = self.reader.submit(loader.symbols_of, p.lib)
                    reading_now += 1
                    continue
                del self.pending[inode]
                self.tracer.finder.known[inode] = p.lib
                self.tracer.failed.append((self.tracer.let_go(p.lib), why))
            elif not p.read.done():
                reading_now += 1
                continue
            else:
                del self.pending[inode]
                self.tracer.finder.known[inode] = p.lib
                if p.container is not None:
                    self.spent.add(p.container, getattr(p.read, "took", 0.0))
                if isinstance(p.read.exception(), untrusted.NotElf):    # no code can come from it
                    self.not_code.add(inode)
                    self.tracer.let_go(p.lib)
                    self.tracer.say(logging.WARNING, (p.container, "not ELF"), "%s is not an ELF file: no code "
                                    "can be loaded from it; its openers are let go", p.lib)
                else:
                    self.tracer.attach(p.lib, p.container, syms=p.read.exception() or p.read.result())
                self.beat(force=True)    # progress: BPF keeps stopping at opens
            n += 1
            self._settle(inode, p.keys)
        return n + looked

    def lost(self) -> int:
        """Stops at an open whose event never reached us (the ring buffer was full: the stats'
        drops): listed in `held`, unchanged since the last look (Held.unchanged), and neither
        waiting for a file nor kept by --unprobed. Looked at as if their event had come; else
        they stayed stopped until the tracer ended. Returns how many."""
        same = self.held.unchanged() if self.enabled else None
        if same is None:
            return 0
        self.lost_looks += 1
        known = {k for p in self.pending.values() for k in p.keys} | {c.key for c in self.identity.checks}
        kept = {pid for pid, u in self.unprobed.items() if u.action == "stall"}
        lost = [(k, v) for k, v in same if k not in known and k >> 32 not in kept]
        for key, v in lost:
            self.lost_events += 1
            pid, tid, fd = key >> 32, key & 0xFFFFFFFF, v & 0xFFFFFFFF
            self.tracer.say(logging.WARNING, (container_of(pid), "lost"), "pid %d was stopped at its open of "
                            "%s %s with no event told (ring buffer full?): looked at now", pid,
                            "a GPU node" if v & HELD_NODE else "a driver file", _seen_as(pid, fd))
            if v & HELD_NODE:
                self.identity.opened(pid, tid, fd, container_of(pid))
            else:
                self.opened(pid, tid, fd)
        return len(lost)

    def _refuse(self, p: Pending) -> str | None:
        """Why p's container may not have it read now, or None (it then counts toward its
        copies, read or failed, until no process of it uses the copy: forget())."""
        p.container = container_of(p.keys[0] >> 32) if p.keys else None
        if p.container is None:
            return None
        if sum(c == p.container for c in self.owner.values()) >= COPIES_PER_CONTAINER:
            return f"its container has {COPIES_PER_CONTAINER} driver copies probed already, the most one may have"
        if self.spent.over(p.container):
            return (f"its container's driver files took {reading.READ_S:g} s of reading in the last "
                    f"{reading.WINDOW_S:g} s, the most one may cause")
        self.owner[p.lib.inode] = p.container
        return None

    def _settle(self, inode, keys):
        failed = None if inode in self.not_code else self.tracer.failure(inode)
        for key in keys:
            if failed is not None:
                lib = self.tracer.finder.known[inode]
                self.hold(key, f"pid {key >> 32} opened {lib}", f"which cannot be probed ({failed})",
                          container_of(key >> 32), lib, failed.replace(str(lib), "*"))
            elif not any(key in p.keys for p in self.pending.values()):   # another copy it maps
                self.identity.going_on(key)
                self.held.resume(key)

    def hold(self, key: int, who: str, why: str, container: str, lib=None, kind=None) -> None:
        """key's process cannot be checked: --unprobed decides (stall, kill or allow), one line."""
        pid = key >> 32
        action = self.on_unprobed(pid, lib, why)
        self.tracer.say(logging.ERROR, (container, kind or why), "%s, %s: %s", who, why, WHAT[action])
        self.unprobed[pid] = Unprobed(pid, str(lib) if lib is not None else "", why, action)
        self.identity.forget(key)
        if action == "kill":
            os.kill(pid, signal.SIGKILL)
            self.held.resume(key)     # a SIGKILL needs no SIGCONT; the entry goes all the same
        elif action == "allow":
            self.held.resume(key)
        # stall: it stays in `held` (the watchdog resumes it if we die), stopped

    def enqueue(self, lib: Library, key: int) -> None:
        """A driver copy found by what it exports (probes/identity.py): read and attached like
        an opened one, its process held until then."""
        self.pending[lib.inode] = Pending(lib, [key])

    def forget(self, inode) -> None:
        """A copy released (no process uses it): its container may have another."""
        self.owner.pop(inode, None)
        self.not_code.discard(inode)
        self.openers.pop(inode, None)

    def in_use(self, inode) -> bool:
        """A process that opened this copy is still alive (the scan of maps is the tracer's)."""
        pids = self.openers.get(inode, set())
        pids.intersection_update(p for p in list(pids) if os.path.exists(f"/proc/{p}"))
        if not pids:
            self.openers.pop(inode, None)
        return bool(pids)

    def sweep(self):
        """Forget processes held for an unprobed file that have gone (BPF drops their threads)."""
        for pid in list(self.unprobed):
            if not os.path.exists(f"/proc/{pid}"):
                del self.unprobed[pid]


def _seen_as(pid: int, fd: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return f"/proc/{pid}/fd/{fd}"


def _shown(pid: int, seen_as: str) -> str:
    """How logs name a copy: its path, through the process's root unless that is ours."""
    try:
        a, b = os.stat(f"/proc/{pid}/root"), os.stat("/")
        if (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino):
            return seen_as
    except OSError:
        pass
    return f"/proc/{pid}/root{seen_as}"
