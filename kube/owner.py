"""One Kubernetes agent per GPU: the device plugin (`convgpu kube`) or the DRA plugin (`convgpu
kube --dra`), never both. Each would share the card's memory out on its own (units to the
kubelet, a ResourceSlice to the scheduler), so the scheduler would promise it twice.

An agent holds an exclusive flock on <run dir>/kube/<GPU key>.lock for each GPU it serves, for
as long as it runs; the kernel drops the lock with the process (a kill -9 too), so a restarted
agent takes its GPUs back. A GPU whose lock the other agent holds is left out, with one line
saying who holds it. The run dir is the host's /run/convgpu in both DaemonSets, so the lock is
one file on the node (the enforcer refuses the mix too: enforcer/serving/claimlimits.py)."""
import fcntl
import logging
import os
import re

log = logging.getLogger(__name__)
MODES = ("device-plugin", "dra")


class Owner:
    def __init__(self, run_dir: str, mode: str):
        if mode not in MODES:
            raise ValueError(mode)
        self.dir = os.path.join(run_dir, "kube")
        self.mode = mode
        self.held: dict[str, int] = {}       # GPU key -> the lock file's fd
        self.refused: dict[str, str] = {}    # GPU key -> who holds it (said once)

    def _path(self, key: str) -> str:
        return os.path.join(self.dir, re.sub(r"[^A-Za-z0-9._-]", "_", key)[:128] + ".lock")

    def take(self, key: str) -> bool:
        if key in self.held:
            return True
        os.makedirs(self.dir, mode=0o755, exist_ok=True)
        fd = os.open(self._path(key), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another agent"
            os.close(fd)
            if self.refused.get(key) != holder:
                log.error("GPU %s is served by %s: left out of the %s (a node runs the device plugin or DRA "
                          "on a GPU, never both)", key, holder, self.mode)
            self.refused[key] = holder
            return False
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"the {self.mode} (pid {os.getpid()})\n".encode(), 0)
        self.held[key] = fd
        self.refused.pop(key, None)
        return True

    def filter(self, gpus: list) -> list:
        """The GPUs this agent may serve (their locks taken now, or held already)."""
        return [g for g in gpus if self.take(g.key)]

    def close(self):
        for fd in self.held.values():
            os.close(fd)
        self.held.clear()
