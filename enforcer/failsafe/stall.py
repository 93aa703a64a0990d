"""Stopping and resuming a container's work: one interface, three backends (modelled on runc's
libcontainer/cgroups/fs2/freezer.go and fs/freezer.go).

Facts measured on kernel 6.18 (2026-11-22) that shape the choices below:
- v2 freeze of one busy thread ~0.1 ms, thaw ~0.04 ms; v1 freeze ~0.13 ms. Either is cheap enough
  to stall on every over-limit allocation, so waits poll at 1 ms granularity or better.
- SIGSTOP is advisory: any process allowed to signal the target can SIGCONT it (the container
  itself, a sibling). The freezer is not undone by SIGCONT, hence `escaped()` for the signal
  backend only, and "freezer" as the backend to prefer where there is one.
- SIGKILL of a v2-frozen task completes at once; a v1-frozen task dies only after thaw, so whoever
  kills a v1-stalled container must resume() it after the kill.
Errors are StallError (one line with its remedy). A failed stall undoes itself: nothing is ever
left half-frozen or half-stopped."""
from __future__ import annotations

import errno
import functools
import os
import posixpath
import select
import signal
import threading
import time
from dataclasses import dataclass
from typing import Protocol

from ...errors import ConvgpuError
from ..tenants.cgroupfs import Layout, cgroup_layout

DEFAULT_TIMEOUT = 2.0
_GONE_ERRNOS = (errno.ENOENT, errno.ENODEV, errno.ENOTDIR, errno.ESRCH)


class StallError(ConvgpuError):
    pass


@dataclass(frozen=True)
class Target:
    pids: tuple[int, ...] = ()   # processes (signal backend)
    cgroup: str | None = None    # cgroup path "/..." of the container (freezer backends)


class Stopper(Protocol):
    name: str   # "signal" | "freezer-v1" | "freezer-v2"
    def stall(self, target: Target) -> None: ...    # idempotent
    def resume(self, target: Target) -> None: ...   # idempotent; a vanished target is no error
    def state(self, target: Target) -> str: ...     # "running" | "stopped" | "gone"


def _wait(check, timeout: float, fd: int | None = None) -> bool:
    """Call check() until it returns True or timeout passes. A freeze usually completes in
    ~0.1 ms, so the first sleeps are short, growing to 1 ms. With fd (a cgroup.events file)
    the kernel wakes us by POLLPRI when it changes; the 1 ms poll timeout still covers plain
    files (never POLLPRI). The v1 freezer has no notification at all: sleep-poll."""
    deadline = time.monotonic() + timeout
    p = select.poll() if fd is not None else None
    if p is not None:
        p.register(fd, select.POLLPRI)
    delay = 0.00005
    while True:
        if check():
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        if p is not None and delay >= 0.001:
            p.poll(min(left, 0.001) * 1000)
        else:
            time.sleep(min(left, delay))
            delay = min(delay * 2, 0.001)


# ---------------------------------------------------------------- signals

def _stat(pid: int, proc: str) -> tuple[str, int] | None:
    """(state letter, start time) from /proc/<pid>/stat, None if the process is gone."""
    try:
        with open(f"{proc}/{int(pid)}/stat", encoding="utf-8", errors="replace") as f:
            text = f.read()
        fields = text.rsplit(")", 1)[1].split()   # comm (field 2) may hold spaces and ")"
        return fields[0], int(fields[19])          # field 3 state, field 22 starttime
    except (OSError, IndexError, ValueError):
        return None


def _dead(st: tuple[str, int] | None, start: int | None = None) -> bool:
    # Zombies/dead tasks count as gone; so does a reused pid (other start time than at stall).
    return st is None or st[0] in "ZXx" or (start is not None and st[1] != start)


class SignalStopper:
    """SIGSTOP/SIGCONT per pid. Works everywhere, but stops only the listed pids (not children
    forked later) and is undone by anyone's SIGCONT: see escaped()."""
    name = "signal"

    def __init__(self, proc: str = "/proc", timeout: float = DEFAULT_TIMEOUT):
        self.proc = proc
        self.timeout = timeout
        self._lock = threading.Lock()
        self._ours: dict[Target, dict[int, int]] = {}   # stalled by us: pid -> start time

    def _stopped(self, pids: dict[int, int]) -> bool:
        for pid, start in pids.items():
            st = _stat(pid, self.proc)
            if not _dead(st, start) and st[0] not in "Tt":   # "t": stopped under ptrace
                return False
        return True

    @staticmethod
    def _send(pids, sig) -> list[int]:
        denied = []
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
            except PermissionError:
                denied.append(pid)
        return denied

    def stall(self, target: Target) -> None:
        live = {p: st[1] for p in target.pids if not _dead(st := _stat(p, self.proc))}
        if not live:
            raise StallError(f"no process of {list(target.pids)} is alive to stall",
                             "the container has exited; nothing to stall")
        denied = self._send(live, signal.SIGSTOP)
        if denied:
            self._send(live, signal.SIGCONT)
            raise StallError(f"not allowed to signal pids {denied}", "run as root")
        # SIGSTOP is delivered asynchronously; a task in the kernel (D state, e.g. inside a
        # driver ioctl) stops only on its way back to user space. Wait so that "stall returned"
        # means "not running", as with the freezer. /proc/<pid>/stat shows the main thread;
        # the other threads join the group stop on their own way out of the kernel.
        if not _wait(lambda: self._stopped(live), self.timeout):
            self._send(live, signal.SIGCONT)   # SIGCONT also discards a still-pending SIGSTOP
            with self._lock:
                self._ours.pop(target, None)
            raise StallError(f"pids {list(live)} did not stop within {self.timeout:g} s",
                             "a task is stuck in the kernel (D state); retry later")
        with self._lock:
            self._ours.setdefault(target, live)

    def resume(self, target: Target) -> None:
        with self._lock:
            ours = self._ours.pop(target, None)
        # Only pids whose start time still matches: never SIGCONT a reused pid.
        pids = ours if ours is not None else {p: None for p in target.pids}
        self._send([p for p, s in pids.items() if not _dead(_stat(p, self.proc), s)],
                   signal.SIGCONT)

    def state(self, target: Target) -> str:
        with self._lock:
            ours = self._ours.get(target) or {}
        live = [st for p in target.pids if not _dead(st := _stat(p, self.proc), ours.get(p))]
        if not live:
            return "gone"
        return "stopped" if all(st[0] in "Tt" for st in live) else "running"

    def escaped(self, target: Target) -> bool:
        """Stalled by us, yet one of its processes runs again: someone sent SIGCONT."""
        with self._lock:
            ours = self._ours.get(target)
        return ours is not None and not self._stopped(ours)


# ---------------------------------------------------------------- cgroup freezers

class _Freezer:
    """Shared by both freezers: they freeze the whole cgroup, processes forked later included,
    and SIGCONT cannot undo them. Subclasses give _set(dir, frozen) -> reached within timeout."""
    name = FILE = ""

    def __init__(self, root: str, timeout: float = DEFAULT_TIMEOUT):
        self.root = root.rstrip("/")
        self.timeout = timeout

    def _dir(self, target: Target) -> str:
        if not target.cgroup:
            raise StallError("the freezer needs the container's cgroup", "use --stall signal")
        cg = posixpath.normpath("/" + target.cgroup.strip("/"))   # ".." cannot leave root
        if cg == "/":
            raise StallError("refusing to freeze the root cgroup (the whole host)",
                             "give the container's own cgroup")
        return self.root + cg

    def _change(self, target: Target, frozen: bool) -> bool:
        d = self._dir(target)
        try:
            return self._set(d, frozen)
        except OSError as e:
            if e.errno in _GONE_ERRNOS:
                raise StallError(f"cgroup {target.cgroup} is gone (no {d}/{self.FILE})",
                                 "the container has exited; nothing to stall") from None
            raise StallError(f"cannot write {d}/{self.FILE}: {e.strerror}", "run as root") from None

    def stall(self, target: Target) -> None:
        if self._change(target, True):
            return
        try:
            self._change(target, False)   # thaw: never leave a half-frozen cgroup behind
        except StallError:
            pass
        raise StallError(f"cgroup {target.cgroup} did not freeze within {self.timeout:g} s",
                         "a task is stuck in the kernel; retry, or use --stall signal")

    def resume(self, target: Target) -> None:
        try:
            ok = self._change(target, False)
        except StallError:
            if self.state(target) == "gone":
                return
            raise
        if not ok:   # e.g. a parent cgroup is frozen by someone else
            raise StallError(f"cgroup {target.cgroup} did not thaw within {self.timeout:g} s",
                             f"check {self.FILE} of its parent cgroups")

    def state(self, target: Target) -> str:
        try:
            with open(f"{self._dir(target)}/{self.STATE_FILE}", encoding="ascii") as f:
                return "stopped" if self._is_frozen(f.read()) else "running"
        except OSError as e:
            if e.errno in _GONE_ERRNOS:
                return "gone"
            raise

    @staticmethod
    def _write(path: str, value: str) -> None:
        with open(path, "w", encoding="ascii") as f:   # one write(2) at close; errors raise there
            f.write(value)


class FreezerV2(_Freezer):
    """cgroup2 cgroup.freeze; a v2-frozen task can still be SIGKILLed at once."""
    name, FILE, STATE_FILE = "freezer-v2", "cgroup.freeze", "cgroup.events"

    @staticmethod
    def _is_frozen(events: str) -> bool:
        return "frozen 1" in events.splitlines()   # set once every task of the subtree froze

    def _set(self, d: str, frozen: bool) -> bool:
        fd = os.open(f"{d}/cgroup.events", os.O_RDONLY)

        def check() -> bool:
            os.lseek(fd, 0, os.SEEK_SET)   # re-reading also re-arms POLLPRI on kernfs
            return self._is_frozen(os.read(fd, 4096).decode("ascii", "replace")) == frozen

        try:
            check()   # read before the write so that the change wakes poll()
            self._write(f"{d}/cgroup.freeze", str(int(frozen)))
            return _wait(check, self.timeout, fd)
        finally:
            os.close(fd)


class FreezerV1(_Freezer):
    """v1 freezer.state: THAWED -> FREEZING -> FROZEN, with no change notification, so we
    sleep-poll. A v1-frozen task cannot even die until thawed."""
    name, FILE, STATE_FILE = "freezer-v1", "freezer.state", "freezer.state"

    @staticmethod
    def _is_frozen(text: str) -> bool:
        return text.strip() == "FROZEN"   # FREEZING: some task is not frozen yet

    def _set(self, d: str, frozen: bool) -> bool:
        path = f"{d}/freezer.state"
        self._write(path, "FROZEN" if frozen else "THAWED")

        def check() -> bool:   # reading is what advances FREEZING to FROZEN in the kernel
            with open(path, encoding="ascii") as f:
                return self._is_frozen(f.read()) == frozen

        return _wait(check, self.timeout)


# ---------------------------------------------------------------- choice

@functools.lru_cache(maxsize=1)
def _detected() -> Layout:
    return cgroup_layout()


def detect(layout: Layout | None = None) -> Layout:
    """The host's cgroup layout, read once per process; a given layout is used as is."""
    return layout if layout is not None else _detected()


def v2_has_freeze(root: str) -> bool:
    """cgroup.freeze exists in non-root v2 cgroups from kernel 5.2 on (the root has none).
    With no child cgroup to look at, the kernel version decides."""
    try:
        kids = [e.path for e in os.scandir(root) if e.is_dir(follow_symlinks=False)]
        if kids:
            return any(os.path.exists(f"{k}/cgroup.freeze") for k in kids)
        return tuple(int(x) for x in os.uname().release.split(".")[:2]) >= (5, 2)
    except (OSError, ValueError):
        return False


KINDS = ("signal", "freezer", "freezer-v1", "freezer-v2")


def make_stopper(kind: str, layout: Layout | None = None, *,
                 timeout: float = DEFAULT_TIMEOUT) -> Stopper:
    """kind "signal", or "freezer": v2 where it has cgroup.freeze, else the v1 freezer. On hybrid
    hosts the target's cgroup path is used as given in whichever hierarchy is chosen (podman
    with cgroupfs uses the same path in all of them); pass the path valid for that one."""
    if kind == "signal":
        return SignalStopper(timeout=timeout)
    if kind not in KINDS:
        raise ConvgpuError(f"unknown stall method {kind!r}", f"choose one of {', '.join(KINDS)}")
    lay = detect(layout)
    v2 = bool(lay.v2_root and v2_has_freeze(lay.v2_root))
    v1 = bool(lay.freezer_v1_root and os.path.isdir(lay.freezer_v1_root))
    if kind in ("freezer", "freezer-v2") and v2:
        return FreezerV2(lay.v2_root, timeout)
    if kind in ("freezer", "freezer-v1") and v1:
        return FreezerV1(lay.freezer_v1_root, timeout)
    raise ConvgpuError(f"no cgroup {kind} on this host ({lay.mode} cgroups)",
                       "use --stall signal, --stall freezer, or mount the freezer")
