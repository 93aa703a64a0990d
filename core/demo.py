"""The bundled demo for hosts without an NVIDIA driver: a few workers in two or three
containers (podman, where it works) or plain cgroups, allocating through the test stand-in
driver, so `convgpu trace` has something real to show.

Nothing of it may outlive its `convgpu trace`: containers left running held the stand-in's
memory, and the next test run failed. So every container carries the LABEL and its owner (pid
and start time of the trace that made it), and every worker gets the owner too and exits when
it is gone (podman: --pid host lets it see the owner; cgroups: also PR_SET_PDEATHSIG). stop()
removes everything the owner made, also when a signal cut start() short; a new start removes
what a dead owner left and refuses to run beside a live one (the names are fixed)."""
import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from .enforcer.tenants.cgroupfs import cgroup_layout, remove_cgroup
from .errors import ConvgpuError, PrerequisiteError
from .paths import REPO, standin_libcuda

log = logging.getLogger(__name__)
WORKER = Path(__file__).with_name("demo_worker.py")
GROUPS = (("alpha", 2), ("beta", 1), ("gamma", 1))   # (name, processes)
ROOTFS = Path("/var/lib/convgpu/demo-rootfs")
LABEL = "convgpu.demo"
OWNER_LABEL = "convgpu.demo.owner"     # "PID:START" of the `convgpu trace` that made it
CGROUP_DIR = "convgpu-demo"            # under the cgroup2 root, for the cgroups kind
# Its own copy of the stand-in driver (another inode: probes on the build's file, as the tests
# attach them, never see the demo) and its own stand-in segment (its workers never draw from the
# capacity that other stand-in users share): a demo left running failed the next test run.
DRIVER_DIR = Path("/var/lib/convgpu/demo-driver")
SHM = "/convgpu-demo"
# The stand-in charges each context this much, like a real driver's context (the paper saw
# 66 MiB per process on a K20m; an H100 with driver 580 costs ~519 MiB); the view estimates
# the same figure, since there is no NVML to measure it.
CTX_OVERHEAD = 64 << 20


def start_time(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat (clock ticks after boot), None when there is no such process:
    with the pid it names one process for good (a pid alone may be reused)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def owner_tag(pid: int | None = None) -> str:
    pid = os.getpid() if pid is None else pid
    return f"{pid}:{start_time(pid)}"


def owner_alive(tag: str) -> bool:
    pid, _, start = tag.partition(":")
    return pid.isdigit() and start.isdigit() and start_time(int(pid)) == int(start)


def _podman(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    # its own session: the terminal's SIGINT / SIGHUP to our process group must not kill a
    # podman half-way through creating or removing a container
    return subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout,
                          start_new_session=True, stdin=subprocess.DEVNULL)


class Demo:
    def __init__(self, use_podman: bool | None = None, period: float = 2.0):
        built = standin_libcuda()
        if not built.exists():
            raise PrerequisiteError(f"the demo's stand-in driver {built} is not built",
                                    "run scripts/setup.sh (it runs make)")
        self.lib = _driver_copy(built)
        self.period = period
        self.use_podman = shutil.which("podman") is not None if use_podman is None else use_podman
        self.owner = owner_tag()
        self.kind = ""
        self.procs: list[subprocess.Popen] = []
        self.containers: list[str] = []
        self.cgroups: list[Path] = []

    def _args(self, name: str, i: int) -> list[str]:
        return [str(WORKER), str(self.lib), "--period", str(self.period), "--seed", str(hash(name) % 1000 + i),
                "--owner", self.owner]

    def start(self) -> "Demo":
        clear_leftovers(self.owner)
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
            # The workers are stdlib Python: the host's /usr and libs, read-only, are enough.
            shell = " & ".join(f"/usr/bin/python3 {' '.join(self._args(name, i))}" for i in range(n)) + " & wait"
            cmd = ["--cgroup-manager=cgroupfs", "--runtime", "runc", "run", "-d", "--rm",
                   "--network", "none", "--cgroupns=host", "--pid", "host", "--name", cname,
                   "--label", "com.nvidia.memory.limit=1GiB", "--label", f"{LABEL}=1",
                   "--label", f"{OWNER_LABEL}={self.owner}"]
            for m in ("/usr", "/lib", "/lib64", "/bin", str(REPO), str(DRIVER_DIR)):
                if os.path.exists(m):
                    cmd += ["-v", f"{m}:{m}:ro"]
            cmd += ["-e", f"CONVGPU_STANDIN_CTX_OVERHEAD={CTX_OVERHEAD}", "-e", f"CONVGPU_STANDIN_SHM={SHM}",
                    "--rootfs", str(ROOTFS), "/bin/sh", "-c", shell]
            self.containers.append(cname)   # before it exists: stop() removes a half-made one too
            r = _podman(*cmd)
            if r.returncode:
                raise subprocess.SubprocessError(f"podman run {cname}: {(r.stderr.strip().splitlines() or ['?'])[-1]}")

    def _start_cgroups(self):
        layout = cgroup_layout()
        if not layout.v2_root:
            raise PrerequisiteError("no cgroup2 hierarchy for the demo", "mount cgroup2 or install podman")
        base = Path(layout.v2_root) / CGROUP_DIR
        for name, n in GROUPS:
            cg = base / name
            cg.mkdir(parents=True, exist_ok=True)
            self.cgroups.append(cg)
            for i in range(n):
                env = dict(os.environ, CONVGPU_STANDIN_CTX_OVERHEAD=str(CTX_OVERHEAD), CONVGPU_STANDIN_SHM=SHM)
                self.procs.append(subprocess.Popen([sys.executable] + self._args(name, i) + ["--cgroup", str(cg)],
                                                   env=env, stdin=subprocess.DEVNULL, start_new_session=True))

    def stop(self) -> None:
        """Removes all this demo made: its workers, and every container labelled with its owner
        (also one a signal interrupted while podman created it)."""
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self.containers or self.use_podman:
            ids = _labelled(f"{OWNER_LABEL}={self.owner}")
            if self.containers or ids:
                _podman("rm", "-f", "-t", "0", "--ignore", *self.containers, *ids)
        for cg in self.cgroups:
            remove_cgroup(cg, 100, 0.05)
        if self.cgroups:
            try:
                self.cgroups[0].parent.rmdir()
            except OSError:
                pass
        self.procs, self.containers, self.cgroups = [], [], []


def _driver_copy(built: Path) -> Path:
    """DRIVER_DIR's copy of the built stand-in, made again when the build is newer."""
    dest = DRIVER_DIR / built.name
    src = built.stat()
    try:
        st = dest.stat()
        if (st.st_size, st.st_mtime_ns) == (src.st_size, src.st_mtime_ns):
            return dest
    except FileNotFoundError:
        pass
    DRIVER_DIR.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{built.name}.{os.getpid()}")
    shutil.copy2(built, tmp)
    os.replace(tmp, dest)   # a running worker keeps the old inode
    return dest


def _labelled(label: str) -> list[str]:
    """Ids of the podman containers (any state) that carry `label` ("key" or "key=value")."""
    if shutil.which("podman") is None:
        return []
    try:
        r = _podman("ps", "-a", "-q", "--no-trunc", "--filter", f"label={label}", timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    return r.stdout.split() if r.returncode == 0 else []


def _owner_of_container(cid: str) -> str:
    r = _podman("inspect", "--format", f'{{{{index .Config.Labels "{OWNER_LABEL}"}}}}', cid, timeout=30)
    return r.stdout.strip() if r.returncode == 0 else ""


def _worker_owner(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
    except OSError:
        return ""
    return argv[argv.index("--owner") + 1] if "--owner" in argv[:-1] else ""


def leftovers() -> dict[str, list]:
    """What demos left on this host: {"containers": [(id, owner)], "workers": [(pid, owner, cgroup)]}."""
    out: dict[str, list] = {"containers": [], "workers": []}
    for cid in _labelled(LABEL):
        out["containers"].append((cid, _owner_of_container(cid)))
    root = cgroup_layout().v2_root
    base = Path(root) / CGROUP_DIR if root else None
    if base is not None and base.is_dir():
        for cg in sorted(p for p in base.iterdir() if p.is_dir()):
            try:
                pids = [int(x) for x in (cg / "cgroup.procs").read_text().split()]
            except OSError:
                continue
            out["workers"] += [(pid, _worker_owner(pid), cg) for pid in pids]
    return out


def clear_leftovers(me: str | None = None) -> dict[str, list]:
    """Remove what the demos of earlier, dead `convgpu trace`s left; returns what was removed.
    A demo whose owner still runs is not touched: ConvgpuError (the names are fixed, and two
    demos would show each other's workers)."""
    found = leftovers()
    live = sorted({o for _, o in found["containers"]} | {o for _, o, _ in found["workers"]})
    live = [o for o in live if o and o != me and owner_alive(o)]
    if live:
        pid = live[0].split(":")[0]
        raise ConvgpuError(f"the demo of another `convgpu trace` (pid {pid}) is running",
                           f"end that one (kill {pid}), or run this one with --demo never")
    if found["containers"]:
        ids = [c for c, _ in found["containers"]]
        log.warning("removing %d container(s) an earlier demo left: %s", len(ids), " ".join(c[:12] for c in ids))
        _podman("rm", "-f", "-t", "0", "--ignore", *ids)
    if found["workers"]:
        log.warning("ending %d worker(s) an earlier demo left: %s", len(found["workers"]),
                    " ".join(str(p) for p, _, _ in found["workers"]))
        for pid, _, _ in found["workers"]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for cg in sorted({cg for _, _, cg in found["workers"]}):
            remove_cgroup(cg, 100, 0.05)
    root = cgroup_layout().v2_root
    base = Path(root) / CGROUP_DIR if root else None
    if base is not None and base.is_dir():   # empty ones too (a worker that ended alone)
        for cg in [p for p in base.iterdir() if p.is_dir()] + [base]:
            try:
                cg.rmdir()
            except OSError:   # a live demo's, with its workers in it
                pass
    return found
