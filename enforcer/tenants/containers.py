"""Which container a process or cgroup belongs to: pure parsing of cgroup paths plus small
/proc readers (the cgroupfs itself: tenants/cgroupfs.py). No engine is ever asked here
(engines.py does that, optionally): the cgroup path alone names the container, so accounting
works with no engine socket at all."""
from __future__ import annotations

import functools
import os
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass

from ...errors import NotFoundError
from .cgroupfs import _norm, cgroup_layout
from .cgroupfs import remove_cgroup  # noqa: F401  (bench/ imports it from here)

KINDS = ("docker", "containerd", "kubernetes", "crio", "podman", "systemd", "cgroup", "host")
# Kinds whose id is an engine's container id: membership of such a cgroup never changes for a
# process, so only these results may be cached per pid (see container_of_pid).
ENGINE_KINDS = frozenset({"docker", "containerd", "kubernetes", "crio", "podman"})

_HEX64 = re.compile(r"[0-9a-f]{64}")
# /system.slice/docker-<64hex>.scope, .../cri-containerd-<64hex>.scope, .../crio-<64hex>.scope,
# /machine.slice/libpod-<64hex>.scope, /system.slice/nerdctl-<64hex>.scope; the cgroupfs
# drivers use the same names without ".scope" (/libpod_parent/libpod-<64hex>, .../crio-<64hex>).
_ENGINE_UNIT = re.compile(r"(docker|cri-containerd|crio|libpod|nerdctl)-([0-9a-f]{64})"
                          r"(?:\.scope)?")
# .../crio-conmon-<64hex>.scope, /machine.slice/libpod-conmon-<64hex>.scope: the monitor
# process next to a container, not the container, so it must not be charged to it.
_CONMON = re.compile(r"(?:crio|libpod)-conmon-[0-9a-f]+(?:\.scope)?")
# /kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid_with_underscores>.slice
# (also kubepods-pod<uid>.slice for Guaranteed pods, and kind's kubelet-kubepods-...-pod<uid>).
_POD_SLICE = re.compile(r"(?:[\w.-]*-)?kubepods(?:-[a-z]+)?-pod([0-9a-f][0-9a-f_]*)\.slice")
# /kubepods/burstable/pod<uid-with-dashes> (cgroupfs driver; static pods use a 32-hex hash)
_POD_DIR = re.compile(r"pod([0-9a-f][0-9a-f-]*)")
# /system.slice/ssh.service, /user.slice/user-0.slice/session-3.scope
_UNIT = re.compile(r".+\.(?:scope|service)")
_ENGINE_PREFIX_KIND = {"docker": "docker", "cri-containerd": "kubernetes", "crio": "crio",
                       "libpod": "podman", "nerdctl": "containerd"}


@dataclass(frozen=True)
class Container:
    kind: str          # one of KINDS
    id: str            # 64-hex engine id | pod uid | cgroup path (systemd units too) | "host"
    cgroup: str        # the full cgroup path, v2 style "/..."
    pod: str | None = None  # kubernetes pod uid (dashes) the cgroup lies in, whatever the kind

    @property
    def short(self) -> str:
        """Display name when no engine gives one."""
        if _HEX64.fullmatch(self.id):
            return self.id[:12]
        if self.kind == "kubernetes":  # pod level: the id is the pod uid
            return "pod-" + self.id[:8]
        if self.kind == "systemd":   # its id is its path: the unit's name is the last component
            return re.sub(r"\.(scope|service)$", "", self.id.rsplit("/", 1)[-1])
        if self.kind == "host":
            return "host"
        return self.id.rstrip("/").rsplit("/", 1)[-1] or self.id

    @property
    def unit(self) -> str | None:
        """A systemd unit's name as systemd shows it (`victim.service`; its id is its path, its
        short name `victim`): a limit names a unit by either (issue 47: one that named it by its
        file name fell to the default, said nowhere). None for anything but a unit. A unit's
        name is one of its manager's: the system's are root's, a user's are under its delegated
        user@UID.service, one container (delegation_cut), so no tenant makes one named like it."""
        return self.id.rsplit("/", 1)[-1] if self.kind == "systemd" else None


def container_of_path(path: str) -> Container:
    """Classify a cgroup path by the runtime's own cgroup: the outermost component at a place
    where only a runtime (root) makes cgroups (runtime_container), never a name further in. A
    container given cgroup delegation can make sub-cgroups named like a neighbour
    (docker-<victim id>.scope: issue 24 row 8); every sub-cgroup is its enclosing container,
    and the Container's cgroup is that container's own, so a freezer stall freezes all of it
    and nothing else. Not a container: the outermost systemd unit, else the path itself
    (/convgpu.run/<name>: `convgpu run`'s cgroup, whatever its sub-cgroups)."""
    path = _norm(path)
    if path == "/":
        return Container("host", "host", "/")
    parts = path[1:].split("/")
    found = runtime_container(parts)
    if found is not None:
        kind, cid, n, pod = found
        cg = "/" + "/".join(parts[:n])
        return Container(kind, cg if kind == "systemd" else cid, cg, pod)
    for i, comp in enumerate(parts):
        if _UNIT.fullmatch(comp):   # identified by its path, never by its name (issue 39 attack 3)
            cg = "/" + "/".join(parts[:i + 1])
            return Container("systemd", cg, cg)
    if parts[0] == "convgpu.run" and len(parts) > 2:
        path = "/" + "/".join(parts[:2])
    return Container("cgroup", path, path)


# A kubernetes QoS level between the kubepods root and the pod (cgroupfs and systemd drivers)
_QOS = re.compile(r"burstable|besteffort|guaranteed|(?:[\w.-]*-)?kubepods-(?:burstable|besteffort|guaranteed)\.slice")


def runtime_container(parts: list[str]) -> tuple[str, str, int, str | None] | None:
    """(kind, id, components of its cgroup, pod uid) where the path lies in a runtime's
    container, matched only where the runtime makes it: /docker/<id>, /system.slice/<engine>-<id>
    .scope, /machine.slice/libpod-<id>.scope (also in a podman pod's slice), /libpod_parent/
    libpod-<id>, a containerd namespace /<ns>/<id>, rootless podman under user@<uid>.service,
    and the container directly in a pod under the kubepods root (kind's node: kubelet.slice/
    kubelet-kubepods.slice)."""
    first = parts[0]
    kube = _kubepods_root(parts)
    if kube:
        return _pod_container(parts, kube)
    if len(parts) < 2:
        return None
    second = parts[1]
    if first == "docker":
        return ("docker", second, 2, None) if _HEX64.fullmatch(second) else None
    if first in ("system.slice", "machine.slice", "libpod_parent"):
        if first == "machine.slice" and second.startswith("machine-libpod_pod_") and len(parts) > 2:
            m = _ENGINE_UNIT.fullmatch(parts[2])
            return ("podman", m.group(2), 3, None) if m and m.group(1) == "libpod" else None
        return _engine(second, 2, None, pod_level=False) if first != "libpod_parent" or \
            second.startswith("libpod-") else None
    if first == "user.slice":   # rootless podman: .../user@<uid>.service/[user.slice/]libpod-<id>.scope
        if len(parts) > 3 and parts[2].startswith("user@"):
            at = 4 if parts[3] == "user.slice" and len(parts) > 4 else 3
            m = _ENGINE_UNIT.fullmatch(parts[at])
            return ("podman", m.group(2), at + 1, None) if m and m.group(1) == "libpod" else None
        return None
    if _HEX64.fullmatch(second):   # a containerd namespace at the top: /default/<id>, /k8s.io/<id>
        return ("containerd", second, 2, None)
    return None


def _kubepods_root(parts: list[str]) -> int:
    """Where the pods start (after `kubepods`, `kubepods.slice`, kind's `kubelet.slice/
    kubelet-kubepods.slice`): at the top, as the kubelet makes them, or below plain directories
    only (a prefix no unit, slice or container lies in: a test's, a nested node's); 0: none."""
    for i, comp in enumerate(parts):
        if comp in ("kubepods", "kubepods.slice"):
            return i + 1
        if parts[i:i + 2] == ["kubelet.slice", "kubelet-kubepods.slice"]:
            return i + 2
        if comp.endswith(".slice") or _UNIT.fullmatch(comp) or _ENGINE_UNIT.fullmatch(comp) or _HEX64.fullmatch(comp):
            return 0
    return 0


def _engine(comp: str, n: int, pod: str | None, pod_level: bool):
    """An engine's container (or its monitor) named by the cgroup component at n - 1."""
    if _CONMON.fullmatch(comp):   # the monitor next to a container: not the container
        return ("systemd", comp, n, pod)
    m = _ENGINE_UNIT.fullmatch(comp)
    if m:
        kind = _ENGINE_PREFIX_KIND[m.group(1)]
        # a runtime's container directly inside a pod is that pod's container (podman's own pods aside)
        return ("kubernetes" if pod_level and kind != "podman" else kind, m.group(2), n, pod)
    if pod_level and _HEX64.fullmatch(comp):   # cgroupfs drivers name it by the bare id
        return ("kubernetes", comp, n, pod)
    return None


def _pod_container(parts: list[str], i: int):
    """Under the kubepods root at parts[i]: [QoS level /] pod / container."""
    if i < len(parts) and _pod_component(parts, i) is None and _QOS.fullmatch(parts[i]):
        i += 1
    uid = _pod_component(parts, i) if i < len(parts) else None
    if uid is None:
        return None
    inner = _engine(parts[i + 1], i + 2, uid, pod_level=True) if i + 1 < len(parts) else None
    return inner or ("kubernetes", uid, i + 1, uid)   # the pod itself (sandbox level)


def _pod_component(parts: list[str], i: int) -> str | None:
    """The pod uid (dashes) if parts[i] is a kubernetes pod cgroup, else None."""
    if i < 0:
        return None
    m = _POD_SLICE.fullmatch(parts[i])
    if m:
        return m.group(1).replace("_", "-")
    m = _POD_DIR.fullmatch(parts[i])
    # "pod..." alone is too common a name: trust it only below a kubepods directory.
    if m and any(p.startswith("kubepods") for p in parts[:i]):
        return m.group(1)
    return None


def parse_proc_cgroup(text: str) -> str:
    """The cgroup path to identify a process by, from /proc/<pid>/cgroup.

    Pure v2 has one line "0::/path". Hybrid hosts also list v1 hierarchies, and an engine
    using v1 only (cgroupfs driver, older runc) leaves the process's v2 cgroup at "/" or at
    the cgroup inherited from the daemon (e.g. /system.slice/containerd.service). So: the v2
    path when not "/", unless it names no container while a v1 path does; otherwise the v1
    name=systemd, freezer, memory, then any other non-root v1 path; "/" if nothing."""
    v2 = None
    v1: dict[str, str] = {}
    for line in text.splitlines():
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        hid, ctrls, path = fields
        path = path.strip()
        if path.endswith(" (deleted)"):  # the kernel's mark on a removed v2 cgroup
            path = path[: -len(" (deleted)")]
        if hid == "0" and ctrls == "":
            v2 = path
        else:
            for c in ctrls.split(","):
                v1.setdefault(c, path)
    best_v1 = None
    for key in ("name=systemd", "freezer", "memory", *v1):
        p = v1.get(key)
        if p and p != "/":
            best_v1 = p
            break
    if v2 and v2 != "/":
        if best_v1 is not None and container_of_path(v2).kind not in ENGINE_KINDS \
                and container_of_path(best_v1).kind in ENGINE_KINDS:
            return best_v1
        return v2
    return best_v1 or "/"


def _proc_read(pid: int, proc: str, name: str) -> str:
    try:
        with open(f"{proc}/{int(pid)}/{name}", encoding="utf-8", errors="replace") as f:
            return f.read()
    except (FileNotFoundError, ProcessLookupError, NotADirectoryError):
        raise _gone(pid) from None


def _gone(pid: int) -> NotFoundError:
    return NotFoundError(f"no process {pid}", f"check the pid with `ps -p {pid}`")


def cgroup_of_pid(pid: int, proc: str = "/proc") -> str:
    return parse_proc_cgroup(_proc_read(pid, proc, "cgroup"))


def _start_time(pid: int, proc: str) -> int:
    """Field 22 of /proc/<pid>/stat (clock ticks since boot): with the pid, a unique key."""
    stat = _proc_read(pid, proc, "stat")
    try:  # comm (field 2) may hold spaces and ")": fields 3.. follow the last ")".
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (IndexError, ValueError):
        raise _gone(pid) from None


_CACHE_MAX = 4096
_cache: OrderedDict[tuple[str, int, int], Container] = OrderedDict()
_cache_lock = threading.Lock()


def container_of_pid(pid: int, proc: str = "/proc") -> Container:
    """The container of a live process, LRU-cached by (pid, start time) so that a reused pid
    is never confused with the old one. Only engine containers are cached: before runc or
    systemd moves a new process into its cgroup it sits in the daemon's, and caching that
    would misattribute the process for good."""
    start = _start_time(pid, proc)
    key = (proc, int(pid), start)
    with _cache_lock:
        hit = _cache.get(key)
        if hit is not None:
            _cache.move_to_end(key)
            return hit
    c = container_of_path(delegation_cut(cgroup_of_pid(pid, proc)))
    if _start_time(pid, proc) != start:  # the pid was reused between the two reads
        raise _gone(pid)
    if c.kind in ENGINE_KINDS:
        with _cache_lock:
            _cache[key] = c
            while len(_cache) > _CACHE_MAX:
                _cache.popitem(last=False)
    return c


@functools.cache
def _v2_mount() -> str | None:
    return cgroup_layout().v2_root


def delegation_cut(path: str, root: str | None = None) -> str:
    """path cut at the outermost cgroup delegated to someone (its directory is not root's, or
    others may write it): everything below one is made and named by its delegate, so no name
    there (a unit's, an engine's, a pod's) may say whose it is. Issue 39 attack 3: a tenant made
    TENANT/victim.service, moved itself into it, and was charged as /system.slice/victim.service.
    A delegated tree is one container, its delegate's, with its delegate's limit (rootless
    podman's containers of one user too: that user names them all). root: the cgroup2 mount."""
    root = root if root is not None else _v2_mount()
    parts = [p for p in _norm(path).split("/") if p]
    if root is None or not parts:
        return path
    at = root
    for i, comp in enumerate(parts):
        at = os.path.join(at, comp)
        try:
            st = os.stat(at, follow_symlinks=False)
        except OSError:   # gone, or not in this hierarchy: the path as it is
            return path
        if st.st_uid != 0 or st.st_mode & 0o022:
            return "/" + "/".join(parts[:i + 1])
    return path
