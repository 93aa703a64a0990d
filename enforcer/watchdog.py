"""Fail-safe: no process stays stopped because the enforcer is gone.

The enforcer starts this as a separate session (a kill of the enforcer's process group does
not reach it) and keeps a state file of what it holds stopped: pids it must SIGCONT and
cgroups it froze. When the enforcer dies, even by SIGKILL, its BPF programs detach with its
file descriptors (no new stalls), and this process resumes everything in the file at once.
It learns of the death from a pipe whose write end only the enforcer holds: the kernel closes
it early in the exit, before the ~100 ms per uprobe that releasing the probes costs (a pidfd
fires only after all of that, seconds later with 60 probes).
It also holds the BPF `control` map and first turns admission off: a dying enforcer's probes
stay attached for seconds while the kernel releases them, and a resumed process would
otherwise be stopped again at its next allocation.
    python -m convgpu.enforcer.watchdog ENFORCER_PID STATE_FILE PIPE_FD CONTROL_MAP_FD"""
import ctypes
import json
import os
import select
import signal
import sys
import time


def write_state(path: str, pids, cgroups) -> None:
    """Atomically replace the state file (the watchdog may read it at any moment)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"pids": sorted(pids), "cgroups": sorted(cgroups)}, f)
    os.replace(tmp, path)


def admission_off(map_fd: int) -> bool:
    """bpf(BPF_MAP_UPDATE_ELEM) of control[0] = all zero (struct cg_control: enforcing = 0)."""
    key, value = ctypes.c_uint32(0), (ctypes.c_ubyte * 64)()   # >= sizeof(struct cg_control)

    class Attr(ctypes.Structure):
        _fields_ = [("map_fd", ctypes.c_uint32), ("pad", ctypes.c_uint32), ("key", ctypes.c_uint64),
                    ("value", ctypes.c_uint64), ("flags", ctypes.c_uint64)]
    attr = Attr(map_fd, 0, ctypes.addressof(key), ctypes.addressof(value), 0)
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(321, 2, ctypes.byref(attr), ctypes.sizeof(attr)) == 0   # SYS_bpf, UPDATE_ELEM


def release(path: str) -> tuple[int, int]:
    """Resume what the state file lists; returns (pids signalled, cgroups thawed)."""
    try:
        with open(path) as f:
            state = json.load(f)
    except (OSError, ValueError):
        return 0, 0
    n = 0
    for pid in state.get("pids", []):
        try:
            os.kill(pid, signal.SIGCONT)
            n += 1
        except OSError:
            pass
    thawed = 0
    for d in state.get("cgroups", []):   # full directory paths, v2 or v1
        for name, value in (("cgroup.freeze", "0"), ("freezer.state", "THAWED")):
            try:
                with open(os.path.join(d, name), "w") as f:
                    f.write(value)
                thawed += 1
            except OSError:
                pass
    os.unlink(path)
    return n, thawed


def wait_for_death(pid: int, pipe_fd: int | None = None) -> None:
    if pipe_fd is not None:
        while os.read(pipe_fd, 64):   # EOF: every write end is closed
            pass
        return
    try:
        fd = os.pidfd_open(pid)
    except (OSError, AttributeError):
        while True:           # no pidfd (kernel < 5.3): poll
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)
    select.select([fd], [], [])
    os.close(fd)


def main() -> int:
    pid, path = int(sys.argv[1]), sys.argv[2]
    pipe_fd = int(sys.argv[3]) if len(sys.argv) > 3 else None
    map_fd = int(sys.argv[4]) if len(sys.argv) > 4 else None
    signal.signal(signal.SIGTERM, signal.SIG_IGN)   # only the enforcer's death ends it
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    wait_for_death(pid, pipe_fd)
    if map_fd is not None:
        admission_off(map_fd)
    n, thawed = release(path)
    if n or thawed:
        print(f"convgpu watchdog: enforcer {pid} is gone; resumed {n} processes, thawed {thawed} cgroups",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
