"""The bundled demo for hosts without an NVIDIA driver: a few workers in two or three
containers (podman, where it works) or plain cgroups, allocating through the test stand-in
driver, so `convgpu trace` has something real to show."""
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from .errors import PrerequisiteError
from .paths import REPO, standin_libcuda
from .enforcer.containers import cgroup_layout

log = logging.getLogger(__name__)
WORKER = Path(__file__).with_name("demo_worker.py")
GROUPS = (("alpha", 2), ("beta", 1), ("gamma", 1))   # (name, processes)
ROOTFS = Path("/var/lib/convgpu/demo-rootfs")
# The stand-in charges each context this much, like a real driver's context (the paper saw
# 66 MiB per process on a K20m; an H100 with driver 580 costs ~519 MiB); the view estimates
# the same figure, since there is no NVML to measure it.
CTX_OVERHEAD = 64 << 20


class Demo:
    def __init__(self, use_podman: bool | None = None, period: float = 2.0):
        self.lib = standin_libcuda()
        if not self.lib.exists():
            raise PrerequisiteError(f"the demo's stand-in driver {self.lib} is not built",
                                    "run scripts/setup.sh (it runs make)")
        self.period = period
        self.use_podman = shutil.which("podman") is not None if use_podman is None else use_podman
        self.kind = ""
        self.procs: list[subprocess.Popen] = []
        self.containers: list[str] = []
        self.cgroups: list[Path] = []

    def _args(self, name: str, i: int) -> list[str]:
        return [str(WORKER), str(self.lib), "--period", str(self.period), "--seed", str(hash(name) % 1000 + i)]

    def start(self) -> "Demo":
        if self.use_podman:
            try:
                self._start_podman()
                self.kind = "podman containers"
                return self
            except (OSError, subprocess.SubprocessError) as e:
                log.warning("podman demo failed (%s); using plain cgroups", e)
                self.stop()
        self._start_cgroups()
        self.kind = "cgroups"
        return self

    def _start_podman(self):
        for d in ("proc", "sys", "dev", "tmp", "etc", "usr", "lib", "lib64", "bin"):
            (ROOTFS / d).mkdir(parents=True, exist_ok=True)
        for name, n in GROUPS:
            cname = f"convgpu-demo-{name}"
            subprocess.run(["podman", "rm", "-f", "-t", "0", cname], capture_output=True, timeout=30)
            # The workers are stdlib Python: the host's /usr and libs, read-only, are enough.
            shell = " & ".join(f"/usr/bin/python3 {' '.join(self._args(name, i))}" for i in range(n)) + " & wait"
            cmd = ["podman", "--cgroup-manager=cgroupfs", "--runtime", "runc", "run", "-d", "--rm",
                   "--network", "none", "--cgroupns=host", "--name", cname,
                   "--label", "com.nvidia.memory.limit=1GiB", "--label", "convgpu.demo=1"]
            for m in ("/usr", "/lib", "/lib64", "/bin", str(REPO)):
                if os.path.exists(m):
                    cmd += ["-v", f"{m}:{m}:ro"]
            cmd += ["-e", f"CONVGPU_STANDIN_CTX_OVERHEAD={CTX_OVERHEAD}", "--rootfs", str(ROOTFS), "/bin/sh", "-c", shell]
            subprocess.run(cmd, check=True, capture_output=True, timeout=60)
            self.containers.append(cname)

    def _start_cgroups(self):
        layout = cgroup_layout()
        if not layout.v2_root:
            raise PrerequisiteError("no cgroup2 hierarchy for the demo", "mount cgroup2 or install podman")
        base = Path(layout.v2_root) / "convgpu-demo"
        for name, n in GROUPS:
            cg = base / name
            cg.mkdir(parents=True, exist_ok=True)
            self.cgroups.append(cg)
            for i in range(n):
                env = dict(os.environ, CONVGPU_STANDIN_CTX_OVERHEAD=str(CTX_OVERHEAD))
                self.procs.append(subprocess.Popen([sys.executable] + self._args(name, i) + ["--cgroup", str(cg)], env=env))

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
        if self.containers:
            subprocess.run(["podman", "rm", "-f", "-t", "0"] + self.containers, capture_output=True, timeout=60)
        for cg in self.cgroups:
            for _ in range(50):   # a cgroup can be removed once its last task is gone
                try:
                    cg.rmdir()
                    break
                except OSError:
                    time.sleep(0.05)
        if self.cgroups:
            try:
                self.cgroups[0].parent.rmdir()
            except OSError:
                pass
        self.procs, self.containers, self.cgroups = [], [], []
