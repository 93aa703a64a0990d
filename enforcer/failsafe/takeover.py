"""A restarted enforcer continues the accounting of the one before, exactly.

The enforcer's BPF state lives in maps pinned under /sys/fs/bpf (bpf/maps.bpf.c STATE).
Its watchdog holds duplicates of the probe descriptors; after a crash the old programs stay
attached (admission off) and keep those maps exact. A new enforcer loads its program over the
same maps, attaches, takes `control.owner` (from then on only its programs admit), rebuilds its
containers from the maps and the old state file, and sends the old watchdog SIGTERM: the old
probes detach. Between the two, a call is settled by whichever program returns first (the
other finds the thread's slot empty), so nothing is counted twice.
A clean exit removes the pins: with the probes gone, the maps would go stale."""
import glob
import hashlib
import json
import logging
import os
import shutil
import socket
import subprocess
import time

from ...probes import links
from ..actuator import alive

log = logging.getLogger(__name__)
BPFFS = "/sys/fs/bpf"
DEFAULT_RUN_DIR = "/run/convgpu"
ORPHAN_WAIT = 5.0   # s a start waits for a dead enforcer's watchdog to mark its state file orphaned


def pin_dir_for(run_dir: str) -> str:
    """One pin directory per run dir, so test enforcers never share maps with the real one."""
    if os.path.normpath(run_dir) == DEFAULT_RUN_DIR:
        return f"{BPFFS}/convgpu"
    return f"{BPFFS}/convgpu-{hashlib.sha1(os.path.normpath(run_dir).encode()).hexdigest()[:12]}"


def ensure_bpffs() -> bool:
    if os.path.ismount(BPFFS):
        return True
    r = subprocess.run(["mount", "-t", "bpf", "bpf", BPFFS], capture_output=True, text=True)
    if r.returncode != 0:
        log.warning("cannot mount bpffs on %s (%s): a restart will not keep the accounting",
                    BPFFS, r.stderr.strip())
    return r.returncode == 0


def previous(run_dir: str, own: str, wait: float = ORPHAN_WAIT) -> list[dict]:
    """State files of dead enforcers on this run dir whose watchdog still holds their probes.
    A start right after a kill -9 (systemd's restart, the torture's) can come before the dead
    one's watchdog has resumed what it held and marked its file orphaned: a file whose enforcer
    is dead while a watchdog of it lives is waited for (up to `wait` s). Taken for stale, its
    pins were cleared: the accounting started afresh, and the old probes stayed attached."""
    out = []
    for path in glob.glob(os.path.join(run_dir, "held-*.json")):
        if path == own:
            continue
        pid = int(os.path.basename(path)[5:-5] or 0)
        deadline = time.monotonic() + wait
        while True:
            try:
                with open(path) as f:
                    st = json.load(f)
            except (OSError, ValueError):
                st = None
            if st is None or st.get("orphaned") or alive(pid) or time.monotonic() >= deadline \
                    or not _watchdog_of(pid, path, st.get("watchdog")):
                break
            time.sleep(0.01)
        if st is None:
            continue
        wd = st.get("watchdog")
        if st.get("orphaned") and wd and _is_watchdog(wd):
            st["path"] = path
            out.append(st)
        elif not alive(int(os.path.basename(path)[5:-5] or 0)):
            os.unlink(path)   # nobody left to continue from
    return sorted(out, key=lambda st: st.get("saved", 0))


def retire(prev: list[dict]) -> None:
    """The successor's probes are attached and own admission: the old ones may go."""
    for st in prev:
        try:
            os.kill(st["watchdog"], 15)
        except OSError:
            pass
        try:
            os.unlink(st["path"])
        except OSError:
            pass


def clear(pin_dir: str) -> None:
    shutil.rmtree(pin_dir, ignore_errors=True)


def probe_fds(b) -> list[int]:
    return links.fds(b) + list(b.uprobe_fds.values()) + list(b.tracepoint_fds.values())


class FdSender:
    """Duplicates of every probe descriptor go to the watchdog as they are attached."""

    def __init__(self):
        self.mine, self.theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sent: set[int] = set()

    def send(self, fds: list[int]) -> None:
        new = [fd for fd in fds if fd not in self.sent]
        for i in range(0, len(new), 250):   # SCM_MAX_FD is 253
            socket.send_fds(self.mine, [b"f"], new[i:i + 250])
        self.sent.update(new)

    def drop(self, fds: list[int]) -> None:
        """These links are about to be closed: the watchdog closes its duplicates too, and a
        descriptor number used again later is sent again."""
        from .watchdog import link_id
        ids = [i for i in map(link_id, fds) if i is not None]
        if ids:
            self.mine.send(b"d" + " ".join(map(str, ids)).encode())
        self.sent.difference_update(fds)


def _watchdog_of(pid: int, path: str, wd: int | None) -> bool:
    """A watchdog of enforcer `pid` (state file `path`) lives: the one its file names, else one
    whose arguments name both (killed before it wrote the watchdog's pid)."""
    if wd:
        return _is_watchdog(wd)
    want = [str(pid).encode(), path.encode()]
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
            except OSError:
                continue
            if any(a.endswith(b"watchdog.py") for a in argv[:2]) and argv[2:4] == want:
                return True
    return False


def _is_watchdog(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"watchdog" in f.read()
    except OSError:
        return False
