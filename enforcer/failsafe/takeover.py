"""A restarted enforcer continues the accounting of the one before, exactly.

The enforcer's BPF state lives in maps pinned under /sys/fs/bpf (bpf/convgpu.bpf.c STATE).
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

from ...probes import links
from ..actions import alive

log = logging.getLogger(__name__)
BPFFS = "/sys/fs/bpf"
DEFAULT_RUN_DIR = "/run/convgpu"


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


def previous(run_dir: str, own: str) -> list[dict]:
    """State files of dead enforcers on this run dir whose watchdog still holds their probes."""
    out = []
    for path in glob.glob(os.path.join(run_dir, "held-*.json")):
        if path == own:
            continue
        try:
            with open(path) as f:
                st = json.load(f)
        except (OSError, ValueError):
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


def _is_watchdog(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"watchdog" in f.read()
    except OSError:
        return False
