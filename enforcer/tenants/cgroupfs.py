"""The cgroup filesystem as the enforcer reads it: which hierarchies are mounted where (v2,
hybrid, v1: FACTS.md, both layouts must work), a cgroup's id (the inode BPF sees), an index
from ids back to paths, and removing a cgroup. Which container a path names is
tenants/containers.py's."""
from __future__ import annotations

import os
import re
import threading
import time
from dataclasses import dataclass

from ...errors import ConvgpuError, NotFoundError


def _norm(path: str) -> str:
    return "/" + path.strip().strip("/")


@dataclass(frozen=True)
class Layout:
    mode: str                    # "v2" | "hybrid" | "v1"
    v2_root: str | None          # where cgroup2 is mounted (its ids are what BPF sees)
    freezer_v1_root: str | None  # the v1 freezer hierarchy, when mounted


def _unescape(field: str) -> str:
    # /proc/self/mounts escapes space, tab, newline and backslash as \ooo octal.
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def cgroup_layout(root: str = "/sys/fs/cgroup", mounts_text: str | None = None) -> Layout:
    """v2: cgroup2 mounted at root. hybrid: v1 controllers plus cgroup2 elsewhere (usually
    root/unified). v1: no cgroup2. When the mount table lists no cgroup at all (unreadable,
    or a container's own view) the files under root decide."""
    root = os.path.normpath(root)
    if mounts_text is None:
        try:
            with open("/proc/self/mounts", encoding="utf-8", errors="replace") as f:
                mounts_text = f.read()
        except OSError:
            mounts_text = ""
    v2_mounts: list[str] = []
    v1_mounts: list[tuple[str, list[str]]] = []
    for line in mounts_text.splitlines():
        f = line.split()
        if len(f) < 4:
            continue
        mnt = os.path.normpath(_unescape(f[1]))
        if f[2] == "cgroup2":
            v2_mounts.append(mnt)
        elif f[2] == "cgroup":
            v1_mounts.append((mnt, f[3].split(",")))
    freezer = next((m for m, opts in v1_mounts if "freezer" in opts), None)
    if not v2_mounts and not v1_mounts:
        return _layout_from_files(root)
    under = [m for m in v2_mounts if m == root or m.startswith(root + "/")]
    v2_root = None
    for cand in (root, os.path.join(root, "unified"), *under, *v2_mounts):
        if cand in v2_mounts:
            v2_root = cand
            break
    if v2_root is None:
        mode = "v1"
    elif v2_root == root or not v1_mounts:
        mode = "v2"
    else:
        mode = "hybrid"
    return Layout(mode, v2_root, freezer)


def _layout_from_files(root: str) -> Layout:
    fz = os.path.join(root, "freezer")
    freezer = fz if os.path.exists(os.path.join(fz, "cgroup.procs")) else None
    if os.path.exists(os.path.join(root, "cgroup.controllers")):
        return Layout("v2", root, freezer)
    uni = os.path.join(root, "unified")
    if os.path.exists(os.path.join(uni, "cgroup.controllers")):
        return Layout("hybrid", uni, freezer)
    return Layout("v1", None, freezer)


def _v2_root(layout: Layout) -> str:
    if layout.v2_root is None:
        raise ConvgpuError("no cgroup v2 hierarchy is mounted (cgroup ids come from it)",
                           "mount it: mount -t cgroup2 none /sys/fs/cgroup/unified")
    return layout.v2_root


def cgroup_id(path: str, layout: Layout) -> int:
    """The v2 cgroup id of a path: the inode number of its cgroupfs directory, which is the
    value bpf_get_current_cgroup_id() returns for tasks in it (64-bit kernels)."""
    path = _norm(path)
    full = _v2_root(layout) + ("" if path == "/" else path)
    try:
        return os.stat(full).st_ino
    except (FileNotFoundError, NotADirectoryError):
        raise NotFoundError(f"no cgroup {path} under {layout.v2_root}",
                            "the container may have exited; see /proc/<pid>/cgroup") from None


class CgroupIndex:
    """cgroup id -> path, by walking the v2 tree. Walked lazily on a miss, at most once per
    min_refresh_s (a stream of unknown ids must not turn into a stream of tree walks). Ids are
    never reused within a boot, so entries of removed cgroups are kept (late events of an
    exited container still resolve) until the index grows past max_entries."""

    def __init__(self, layout: Layout, min_refresh_s: float = 1.0, max_entries: int = 65536,
                 clock=time.monotonic):
        self._root = layout.v2_root
        self._min_refresh = min_refresh_s
        self._max = max_entries
        self._clock = clock
        self._by_id: dict[int, str] = {}
        self._last_walk: float | None = None
        self._lock = threading.Lock()

    def path_of(self, cgid: int) -> str | None:
        with self._lock:
            p = self._by_id.get(cgid)
            if p is not None or self._root is None:
                return p
            now = self._clock()
            if self._last_walk is not None and now - self._last_walk < self._min_refresh:
                return None
            self._walk(now)
            return self._by_id.get(cgid)

    def refresh(self) -> None:
        """Walk now (e.g. right after a container starts), whatever the rate limit."""
        with self._lock:
            if self._root is not None:
                self._walk(self._clock())

    def __len__(self) -> int:
        return len(self._by_id)

    def _walk(self, now: float) -> None:
        self._last_walk = now
        if len(self._by_id) > self._max:
            self._by_id = {}
        root = self._root
        try:
            self._by_id[os.stat(root).st_ino] = "/"
        except OSError:
            return
        stack = [(root, "")]
        while stack:  # iterative: deep trees must not hit the recursion limit
            d, rel = stack.pop()
            try:
                it = os.scandir(d)
            except OSError:  # removed while walking
                continue
            with it:
                for e in it:
                    try:
                        if not e.is_dir(follow_symlinks=False):
                            continue
                        ino = e.stat(follow_symlinks=False).st_ino  # same as cgroup_id()
                    except OSError:
                        continue
                    r = f"{rel}/{e.name}"
                    self._by_id[ino] = r
                    stack.append((e.path, r))


PROCS_DIRS = 4096      # sub-cgroups of one container looked at, at most (it may make them: delegation)
PROCS_MAX = 65536      # pids of one container read, at most


def procs_in(cgroup: str, layout: Layout) -> set[int]:
    """Every process in a cgroup and the cgroups below it (v2, else the v1 freezer hierarchy),
    at most PROCS_DIRS directories and PROCS_MAX pids: a container makes its own sub-cgroups.
    Empty where neither hierarchy has it (gone)."""
    base = layout.v2_root or layout.freezer_v1_root
    if base is None:
        return set()
    top = base + ("" if _norm(cgroup) == "/" else _norm(cgroup))
    out: set[int] = set()
    for n, (d, _dirs, files) in enumerate(os.walk(top)):   # cgroupfs holds no links to follow
        if n >= PROCS_DIRS or len(out) >= PROCS_MAX:
            break
        if "cgroup.procs" in files:
            try:
                with open(os.path.join(d, "cgroup.procs"), "rb") as f:
                    out |= {int(x) for x in f.read(1 << 20).split()[:PROCS_MAX]}
            except (OSError, ValueError):
                continue
    return out


def remove_cgroup(d, tries: int = 200, pause: float = 0.01) -> None:
    """rmdir of a cgroup directory: it succeeds once the kernel has moved the last (killed)
    task out, so it is retried `tries` times, `pause` s apart. Gone already: done."""
    for _ in range(tries):
        try:
            os.rmdir(d)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(pause)
