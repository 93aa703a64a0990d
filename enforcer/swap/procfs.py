"""What the swapper reads of a process in /proc and its cgroup (a tenant's: read, never followed
out), and the release agent it stops."""
import os
import signal
import time


def stop_release(pidfile: str):
    """SIGTERM the release agent named in pidfile (agent.py --release writes it), if it runs."""
    try:
        pid = int(open(pidfile).read())
        if b"convgpu.enforcer.swap.agent" in open(f"/proc/{pid}/cmdline", "rb").read():
            os.kill(pid, signal.SIGTERM)
            for _ in range(100):   # it stops between two steps, never inside a driver call
                if not os.path.exists(f"/proc/{pid}"):
                    break
                time.sleep(0.05)
    except (OSError, ValueError):
        pass


def start_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return -1


def cpu_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return 0


def cgroup_room(pid: int) -> int | None:
    """What its memory cgroup (v2 memory.max, v1 memory.limit_in_bytes) has left below its
    limit; None where it has none or it cannot be read."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, ctrls, cg = line.split(":", 2)
        for d, limit, usage in ((f"/sys/fs/cgroup{cg}", "memory.max", "memory.current"),
                                (f"/sys/fs/cgroup/unified{cg}", "memory.max", "memory.current"),
                                (f"/sys/fs/cgroup/memory{cg}", "memory.limit_in_bytes", "memory.usage_in_bytes")):
            if ctrls not in ("", "memory") and "memory" not in ctrls.split(","):
                continue
            try:
                lim = open(os.path.join(d, limit)).read().strip()
                use = int(open(os.path.join(d, usage)).read())
            except (OSError, ValueError):
                continue
            if lim == "max" or int(lim) >= 1 << 60:
                return None
            return int(lim) - use
    return None
