"""Event-driven discovery, fail closed: a process that opens a file named like the driver is
stopped there by BPF (bpf/convgpu.bpf.c, "discovery") and resumed once that file is probed.

A uprobe belongs to an inode, and a container may bring its own driver copy (CUDA forward
compatibility, an image that bundles the driver, a file on an overlay): found by polling /proc,
such a copy was probed a second or more after the process began calling into it, and what it
allocated meanwhile was never seen. Now the open of the file is the checkpoint: its inode is
read through /proc/PID/fd/FD; a known one resumes the process at once, a new one is attached
and self-tested first. A file that cannot be probed is a loud warning, and the caller's
`on_unprobed` decides (trace: let it run; enforce: --unprobed stall|kill|allow).

Nothing stays stopped for good: BPF lists every thread it stops in `held` before the stop,
and the watchdog (enforcer/failsafe/watchdog.py) that runs beside every tracer with discovery on
resumes them all and turns discovery off if the tracer dies."""
import collections
import contextlib
import ctypes as ct
import logging
import os
import signal
import time
from dataclasses import dataclass

from .libs import Library, resolve_in_root
from .table import CUDA

HELD_OPEN = 1 << 32   # bpf/convgpu.bpf.c: a `held` value for a stop at a driver's open (else a stall)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Unprobed:
    """A process held (or killed, or let run) because its driver file could not be probed."""
    pid: int
    library: str
    reason: str
    action: str      # stall: kept stopped; kill; allow: runs unchecked


def allow(pid: int, lib: Library, reason: str) -> str:
    """`convgpu trace`'s choice: a view never holds a process; it says so, loudly."""
    log.warning("pid %d opened %s, which cannot be probed (%s): its calls are NOT seen", pid, lib, reason)
    return "allow"


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

    def _map(self, name: str):
        return self.tracer.b[name.encode()]

    def _write(self, on: bool, exempt: int = 0):
        t = self._map("discovery")
        t[ct.c_int(0)] = t.Leaf(on=int(on), exempt=exempt)

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
        self._write(True)
        self.enabled = True

    def disable(self):
        """Nobody stays stopped: discovery off, then every held process resumed."""
        if not self.enabled:
            return
        self._write(False)
        self.enabled = False
        time.sleep(0.02)   # a program past its check when `on` went to 0 may still stop one
        for key in self._held():
            self._resume(key)
        self.unprobed.clear()
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

    def _held(self) -> list[int]:
        """Threads (pid_tgid) stopped at a driver's open: ours to resume (stalls are the enforcer's)."""
        return [k.value for k, v in self._map("held").items() if v.value & HELD_OPEN]

    def _resume(self, key: int):
        """SIGCONT before the entry goes: dying in between leaves the watchdog one to resume."""
        try:
            os.kill(key >> 32, signal.SIGCONT)
        except ProcessLookupError:
            pass
        try:
            del self._map("held")[ct.c_uint64(key)]
        except KeyError:
            pass

    def opened(self, pid: int, tid: int, fd: int):
        """BPF stopped thread tid of pid right after it opened a driver-named file as fd."""
        key = pid << 32 | tid
        self.stops += 1
        self.recent.append(pid)
        link = f"/proc/{pid}/fd/{fd}"
        try:
            st = os.stat(link)
            seen_as = os.readlink(link)
        except OSError:       # gone already, or closed and reused: nothing to probe
            self._resume(key)
            return
        inode = (st.st_dev, st.st_ino)
        lib = self.tracer.finder.known.get(inode)
        if lib is None:
            lib = self._library(pid, link, seen_as, inode)
            self.tracer.finder.known[inode] = lib
            self.tracer.attach(lib)
        failed = next((err for f, err in self.tracer.failed if f.inode == inode), None)
        if failed is None:
            self._resume(key)
            return
        action = self.on_unprobed(pid, lib, failed)
        self.unprobed[pid] = Unprobed(pid, str(lib), failed, action)
        if action == "kill":
            os.kill(pid, signal.SIGKILL)
            self._resume(key)     # a SIGKILL needs no SIGCONT; the entry goes all the same
        elif action == "allow":
            self._resume(key)
        # stall: it stays in `held` (the watchdog resumes it if we die), stopped

    @staticmethod
    def _library(pid: int, link: str, seen_as: str, key) -> Library:
        """The path to attach: the file as the process sees it, through its root; else (a
        deleted or replaced file) its open descriptor, valid while we attach."""
        host = resolve_in_root(f"/proc/{pid}/root", seen_as)
        try:
            if host and (os.stat(host).st_dev, os.stat(host).st_ino) == key:
                return Library(CUDA, host, key, seen_as)
        except OSError:
            pass
        return Library(CUDA, link, key, seen_as)

    def sweep(self):
        """Forget processes held for an unprobed file that have gone (BPF drops their threads)."""
        for pid in list(self.unprobed):
            if not os.path.exists(f"/proc/{pid}"):
                del self.unprobed[pid]
