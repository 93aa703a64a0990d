"""Podman containers for the security tests (FACTS.md's recipe: podman + runc, cgroupfs,
--cgroupns=host), each named uniquely, the tenant unprivileged (nobody) unless asked, the
stand-in driver mounted read-only from the build folder."""
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

from conftest import need

ROOTFS = Path("/tmp/convgpu-test-rootfs")
PODMAN = ["podman", "--cgroup-manager=cgroupfs", "--runtime", "runc"]


def rootfs() -> Path:
    need(shutil.which("podman") is not None and shutil.which("runc") is not None, "podman and runc not installed")
    for d in ("proc", "sys", "dev", "tmp", "etc", "usr", "lib", "lib64", "bin", "build", "cg"):
        (ROOTFS / d).mkdir(parents=True, exist_ok=True)
    return ROOTFS


class Container:
    """`podman run -i` of argv as a tenant: its stdin/stdout piped, its host pid and cgroup."""

    def __init__(self, build, *argv, user: str = "65534:65534", extra=(), env=None):
        self.name = f"convgpu-sec-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        cmd = [*PODMAN, "run", "-i", "--rm", "--network", "none", "--cgroupns=host", "--name", self.name,
               "--user", user, *extra]
        for m in ("/usr", "/lib", "/lib64", "/bin"):
            if os.path.exists(m):
                cmd += ["-v", f"{m}:{m}:ro"]
        for k, v in (env or {}).items():
            cmd += ["-e", f"{k}={v}"]
        cmd += ["-v", f"{build}:/build:ro", "-e", "LD_LIBRARY_PATH=/build/standin", "--rootfs", str(rootfs()),
                *map(str, argv)]
        self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True)
        self.pid = self._pid()
        self.id = self._inspect("{{.Id}}")

    def _inspect(self, fmt: str) -> str:
        return subprocess.run([*PODMAN, "inspect", "--format", fmt, self.name], capture_output=True, text=True,
                              timeout=60).stdout.strip()

    def _pid(self, timeout: float = 60) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.p.poll() is not None:
                raise AssertionError(f"container {self.name} ended: {self.p.stderr.read()}")
            pid = self._inspect("{{.State.Pid}}")
            if pid.isdigit() and int(pid) > 0:
                return int(pid)
            time.sleep(0.1)
        raise AssertionError(f"container {self.name} never started")

    @property
    def cgroup(self) -> str:
        """Its cgroup v2 path, as the kernel lists it for its first process."""
        for line in open(f"/proc/{self.pid}/cgroup"):
            if line.startswith("0::"):
                return line[3:].strip()
        raise AssertionError(f"no cgroup2 line for pid {self.pid}")

    def remove(self):
        subprocess.run([*PODMAN, "rm", "-f", "-t", "0", self.name], capture_output=True, timeout=60)
        try:
            self.p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
