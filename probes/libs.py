"""Find every libcuda.so.1 (and shared libcudart) that processes on this host use or could use.

A uprobe is attached to a file (an inode), not a path, so libraries are identified by
(st_dev, st_ino): the host driver bind-mounted into containers is one library; an image that
ships its own driver copy (CUDA forward-compat libs, the test stand-in) is another.
Sources: ldconfig, the usual driver paths, the maps of running processes, and container root
filesystems through /proc/<pid>/root."""
import logging
import os
import re
import subprocess
import time
from dataclasses import dataclass, field

from . import untrusted
from .table import CUDA, CUDART

log = logging.getLogger(__name__)

_NAME = {CUDA: re.compile(r"/libcuda\.so(\.[0-9.]+)?$"),
         CUDART: re.compile(r"/libcudart\.so(\.[0-9.]+)?$")}
KNOWN_PATHS = (
    "/usr/lib/x86_64-linux-gnu/libcuda.so.1", "/usr/lib64/libcuda.so.1", "/usr/lib/libcuda.so.1",
    "/lib/libcuda.so.1", "/usr/local/nvidia/lib64/libcuda.so.1", "/usr/local/nvidia/lib/libcuda.so.1",
    "/usr/lib/wsl/lib/libcuda.so.1", "/usr/local/cuda/compat/libcuda.so.1",
    "/usr/lib/aarch64-linux-gnu/libcuda.so.1",
)


@dataclass(frozen=True)
class Library:
    kind: str        # table.CUDA or table.CUDART
    path: str        # a path this process can open (may go through /proc/<pid>/root)
    inode: tuple     # (st_dev, st_ino): what the probes are really attached to
    seen_as: str     # the path as the process that uses it sees it
    # our descriptor of it, opened and checked by probes/untrusted.py: the probes go on this
    # inode (/proc/self/fd/N), never on a path a container could swap meanwhile; -1: none
    fd: int = field(default=-1, compare=False, repr=False)
    trusted: bool = field(default=False, compare=False)   # the host's own: may be self-tested

    def __str__(self):
        return self.path if self.path == self.seen_as else f"{self.seen_as} (via {self.path})"


def kind_of(path: str) -> str | None:
    for kind, rx in _NAME.items():
        if rx.search(path):
            return kind
    return None


def resolve_in_root(root: str, path: str, hops: int = 16) -> str | None:
    """Follow symlinks of `path` as a process whose root is `root` would (an absolute link
    target stays inside that root). Returns a host-openable path, or None."""
    full = root.rstrip("/") + path if root != "/" else path
    for _ in range(hops):
        try:
            target = os.readlink(full)
        except OSError:
            return full if os.path.exists(full) else None
        if target.startswith("/"):
            full = (root.rstrip("/") if root != "/" else "") + target
        else:
            full = os.path.join(os.path.dirname(full), target)
    return None


def _ldconfig_paths() -> list[str]:
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.split("=>")[-1].strip() for line in out.splitlines()
            if "=>" in line and kind_of(line.split("=>")[-1].strip())]


MAPS_CAP = 8 << 20      # bytes of one /proc/PID/maps read (~65,530 mappings, vm.max_map_count)
SWEEP_BUDGET_S = 0.5    # reading every process's maps at a sweep: past it, nothing is released


def _maps(path: str) -> bytes | None:
    """A process's maps, at most MAPS_CAP bytes (a process decides how many mappings it has)."""
    try:
        with open(path, "rb") as f:
            return f.read(MAPS_CAP)
    except OSError:
        return None


def _maps_paths(pid: str, proc: str) -> list[str]:
    data = _maps(f"{proc}/{pid}/maps")
    if not data or b"libcud" not in data:
        return []
    out = set()
    for line in data.split(b"\n"):
        if b"libcud" in line:
            p = line.split(None, 5)[-1].decode(errors="replace")
            if p.endswith(" (deleted)"):
                continue
            if kind_of(p):
                out.add(p)
    return sorted(out)


def mapped_inodes(proc: str = "/proc", budget_s: float = SWEEP_BUDGET_S) -> set[int] | None:
    """The inode number of every file any process maps (a copy renamed after it was mapped is
    still counted); the device is left out, as overlayfs shows the layer's in maps. None if
    reading them all took over budget_s (many processes of many mappings: work a tenant sizes,
    on the loop): the caller then keeps what it would have released."""
    out: set[int] = set()
    try:
        pids = [d for d in os.listdir(proc) if d.isdigit()]
    except OSError:
        return out
    deadline = time.monotonic() + budget_s
    for pid in pids:
        if time.monotonic() > deadline:
            return None
        data = _maps(f"{proc}/{pid}/maps")
        if data is None:
            continue
        for line in data.split(b"\n"):
            parts = line.split(None, 5)
            if len(parts) > 4 and parts[4] != b"0":
                out.add(int(parts[4]))
    return out


def system_drivers() -> list[str]:
    """libcuda files installed on the host itself (ldconfig, usual paths): is there a driver?"""
    found = []
    for p in _ldconfig_paths() + list(KNOWN_PATHS):
        r = resolve_in_root("/", p)
        if r and kind_of(p) == CUDA and os.path.realpath(r) not in found:
            found.append(os.path.realpath(r))
    return found


class LibraryFinder:
    """Keeps the set of known libraries; `scan()` returns the ones not seen before.

    Full scans (ldconfig, known paths, every process) run at start and every `full_every`
    seconds; in between only processes younger than `young` seconds are re-read, because
    frameworks dlopen libcuda lazily, at their first CUDA call, soon after they start."""

    def __init__(self, extra: tuple[str, ...] = (), proc: str = "/proc", full_every: float = 30.0,
                 young: float = 60.0, discover: bool = True, kinds: tuple[str, ...] = (CUDA, CUDART)):
        self.kinds = kinds    # the enforcer's: the driver only (Tracer runtime=False)
        self.extra = tuple(extra)
        self.proc = proc
        self.full_every = full_every
        self.young = young
        self.discover = discover
        self.known: dict[tuple, Library] = {}
        self._last_full = 0.0
        self._first_seen: dict[str, float] = {}
        self._roots_done: set[tuple] = set()
        self._said: set[tuple] = set()

    def _add(self, kind, root, path, seen_as, new):
        """path inside root (probes/untrusted.py: opened there, symlinks kept inside it, never
        blocking), a new library unless its inode is known. A file that cannot be a driver
        (a FIFO, a directory, too big) is skipped, said once per inode."""
        if kind not in self.kinds:
            return
        try:
            fd = untrusted.open_in_root(root, path)
        except OSError:
            return
        try:
            st = untrusted.check(fd)
        except untrusted.Refused as e:
            untrusted.close(fd)
            self._refused(root, path, str(e))
            return
        key = (st.st_dev, st.st_ino)
        if key in self.known:
            untrusted.close(fd)
            return
        if root == "/":
            shown = os.path.realpath(path)
            lib = Library(kind, shown, key, seen_as, fd, untrusted.trusted(shown, st))
        else:
            lib = Library(kind, root + path, key, seen_as, fd)
        self.known[key] = lib
        new.append(lib)

    def _refused(self, root, path, why):
        if (root, path, why) not in self._said:
            self._said.add((root, path, why))
            log.warning("%s%s is not probed: %s", "" if root == "/" else root, path, why)

    def scan(self) -> list[Library]:
        new: list[Library] = []
        for p in self.extra:
            self._add(kind_of(p) or CUDA, "/", os.path.realpath(p), p, new)
        if not self.discover:
            return new
        now = time.monotonic()
        full = now - self._last_full >= self.full_every
        if full:
            self._last_full = now
            for p in _ldconfig_paths() + list(KNOWN_PATHS):
                self._add(kind_of(p), "/", p, p, new)
        try:
            pids = [d for d in os.listdir(self.proc) if d.isdigit()]
        except OSError:
            pids = []
        alive = set(pids)
        for pid in pids:
            first = self._first_seen.setdefault(pid, now)
            if not full and now - first > self.young:
                continue
            root = f"{self.proc}/{pid}/root"
            for p in _maps_paths(pid, self.proc):
                self._add(kind_of(p), root, p, p, new)
            if full:
                self._scan_root(root, new)
        for pid in list(self._first_seen):
            if pid not in alive:
                del self._first_seen[pid]
        return new

    def _scan_root(self, root: str, new: list):
        """A container's own filesystem may hold a driver that no process has loaded yet."""
        try:
            st = os.stat(root)
        except OSError:
            return
        key = (st.st_dev, st.st_ino)
        if key in self._roots_done:
            return
        self._roots_done.add(key)
        for p in KNOWN_PATHS:
            self._add(CUDA, root, p, p, new)
