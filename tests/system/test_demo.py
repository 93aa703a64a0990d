"""`convgpu trace`'s bundled demo (no NVIDIA driver here): nothing of it outlives the command,
however it ends, and a new start removes what an earlier one left. Real podman containers,
real cgroups, the CLI as a subprocess."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import need, remove_cgroup, until

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # bench/ lives at the repo root
from bench.bpf_stats import children  # noqa: E402
from convgpu.enforcer.tenants.containers import cgroup_layout

pytestmark = pytest.mark.system   # one demo on the host (its names are fixed): --dist loadfile keeps these on one worker
TRACE = [sys.executable, "-m", "convgpu.cli.main", "trace", "--json", "--no-events", "--interval", "0.3", "--no-discover"]
DEAD_OWNER = "999999999:1"   # no such pid: an owner that is gone
LABEL, OWNER_LABEL = "convgpu.demo", "convgpu.demo.owner"   # on every demo container (core/demo.py)
CGROUP_DIR = "convgpu-demo"   # the cgroups kind's, under the cgroup2 root


def owner_tag(pid: int) -> str:
    """PID:START, as the demo labels its owner (start: field 22 of /proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        return f"{pid}:{f.read().rsplit(')', 1)[1].split()[19]}"


def demo_containers() -> list[str]:
    r = subprocess.run(["podman", "ps", "-a", "--filter", f"label={LABEL}", "--format", "{{.Names}}"],
                       capture_output=True, text=True, timeout=60)
    return sorted(r.stdout.split())


def demo_workers() -> list[int]:
    """Every demo worker process on the host, in a container or not."""
    out = []
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"demo_worker.py") for a in argv):
            out.append(int(d))
    return out


@pytest.fixture
def podman(root, build):
    need(shutil.which("podman") is not None, "podman not installed")
    need(not os.path.exists("/dev/nvidiactl"), "a driver is here: trace would not run the demo")
    if demo_containers() or demo_workers():
        pytest.skip(f"a demo already runs on this host ({demo_containers()}, workers {demo_workers()}): "
                    "another `convgpu trace` owns it")
    yield
    left = demo_containers()
    subprocess.run(["podman", "rm", "-f", "-t", "0", "--ignore", *left], capture_output=True, timeout=60)


def wait_gone(timeout: float = 20) -> tuple[list, list]:
    deadline = time.monotonic() + timeout
    while (demo_containers() or demo_workers()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return demo_containers(), demo_workers()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
@pytest.mark.parametrize("when", ["starting", "running"])
def test_an_ending_signal_leaves_no_demo_behind(podman, sig, when):
    """SIGTERM (`timeout`, systemd) or SIGHUP (the terminal closed) while podman creates the
    demo's containers, or once they run: trace ends with 0 and no labelled container and no
    worker is left. (A signal during start left the containers podman had made running for good.)"""
    tr = subprocess.Popen(TRACE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        if when == "starting":   # the moment the first `podman run` is under way
            while time.monotonic() < deadline and not any(
                    b"run\0-d" in _cmdline(p) for p in children(tr.pid)):
                time.sleep(0.01)
            time.sleep(0.2)
        else:
            snap = json.loads(tr.stdout.readline())
            assert snap["mode"] == "demo"
            until(lambda: len(demo_workers()) == 4, 30, "the demo's 4 workers")
        assert time.monotonic() < deadline, "trace never started the demo"
        tr.send_signal(sig)
        out, err = tr.communicate(timeout=120)
    finally:
        if tr.poll() is None:
            tr.kill()
            tr.wait()
    assert tr.returncode == 0, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    assert (demo_containers(), demo_workers()) == ([], [])


def test_the_demo_ends_with_its_owner_even_after_sigkill(podman):
    """kill -9 runs no clean-up: the workers see their owner gone and end, and their containers
    (podman --rm) with them."""
    tr = subprocess.Popen(TRACE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert json.loads(tr.stdout.readline())["mode"] == "demo"
        until(lambda: len(demo_workers()) == 4, 30, "the demo's 4 workers")
    finally:
        tr.kill()
        tr.wait()
    assert wait_gone(30) == ([], [])


def test_a_new_start_removes_leftovers_and_refuses_a_live_demo(podman, build, tmp_path):
    """What a dead owner left (a labelled container, a worker in the demo's cgroup) is removed
    by the next start; a demo whose owner runs is not touched, and the start says so."""
    lay = cgroup_layout()
    need(lay.v2_root is not None, "no cgroup2 hierarchy")
    rootfs = tmp_path / "rootfs"
    for d in ("proc", "sys", "dev", "tmp", "usr", "lib", "lib64", "bin"):
        (rootfs / d).mkdir(parents=True)

    def leftover(name, owner):
        cmd = ["podman", "--cgroup-manager=cgroupfs", "--runtime", "runc", "run", "-d", "--rm", "--network", "none",
               "--name", name, "--label", f"{LABEL}=1", "--label", f"{OWNER_LABEL}={owner}"]
        for m in ("/usr", "/lib", "/lib64", "/bin"):
            if os.path.exists(m):
                cmd += ["-v", f"{m}:{m}:ro"]
        subprocess.run(cmd + ["--rootfs", str(rootfs), "/bin/sleep", "600"], check=True, capture_output=True, timeout=60)

    cg = Path(lay.v2_root) / CGROUP_DIR / "alpha"
    cg.mkdir(parents=True, exist_ok=True)
    worker = subprocess.Popen(["/bin/sh", "-c", f'echo $$ > {cg}/cgroup.procs && exec "$0" "$@"', sys.executable,
                               "-c", "import time; time.sleep(600)", "demo_worker.py", "--owner", DEAD_OWNER])
    try:
        leftover("convgpu-demo-old", DEAD_OWNER)
        until(lambda: worker.pid in demo_workers(), 10, "the stale worker in the demo's cgroup")
        r = subprocess.run(TRACE + ["--duration", "0.5"], capture_output=True, text=True, timeout=180)
        assert r.returncode == 0, r.stderr[-2000:]
        assert json.loads(r.stdout.splitlines()[-1])["mode"] == "demo"
        assert worker.wait(timeout=10) == -signal.SIGKILL
        assert (demo_containers(), demo_workers()) == ([], [])
        assert "removing 1 container(s) an earlier demo left" in r.stderr
        assert f"ending 1 worker(s) an earlier demo left: {worker.pid}" in r.stderr

        me = owner_tag(os.getpid())   # a live owner: this test's process
        leftover("convgpu-demo-live", me)
        r = subprocess.run(TRACE + ["--duration", "0.5"], capture_output=True, text=True, timeout=180)
        assert r.returncode == 1
        assert r.stderr.strip().splitlines() == [
            f"convgpu: the demo of another `convgpu trace` (pid {os.getpid()}) is running; "
            f"end that one (kill {os.getpid()}), or run this one with --demo never"]
        assert demo_containers() == ["convgpu-demo-live"]
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        remove_cgroup(cg)
        remove_cgroup(cg.parent)


def test_a_demo_in_cgroups_ends_with_its_owner(root, build):
    """The cgroups kind (no podman): a worker's parent is its owner, and PR_SET_PDEATHSIG ends
    it the moment the owner dies, kill -9 included."""
    need(cgroup_layout().v2_root is not None, "no cgroup2 hierarchy")
    if demo_workers():
        pytest.skip(f"a demo already runs on this host (workers {demo_workers()})")
    owner = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom convgpu.demo import Demo\n"
                              "d = Demo(use_podman=False, period=0.2).start()\nprint(d.kind, flush=True)\n"
                              "time.sleep(600)"], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout.readline().strip() == "cgroups"
        until(lambda: len(demo_workers()) == 4, 20, "the demo's 4 workers")
    finally:
        owner.kill()
        owner.wait()
    try:
        assert wait_gone(10) == ([], [])
    finally:
        base = Path(cgroup_layout().v2_root) / CGROUP_DIR
        # its directories only: rmdir of each of the cgroup's files failed for 2 s of retries (40 s)
        for cg in [*(d for d in base.glob("*") if d.is_dir()), base]:
            remove_cgroup(cg)


@pytest.mark.parametrize("arg", ["--pid", "--lib"])
def test_a_named_target_never_starts_the_demo(root, build, caller_env, arg):
    """--pid N or --lib PATH on a host without a driver watches that, not the demo."""
    need(not os.path.exists("/dev/nvidiactl"), "a driver is here: no demo either way")
    holder = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.readline()"], stdin=subprocess.PIPE)
    try:
        value = str(holder.pid) if arg == "--pid" else str(build / "standin" / "libcuda.so.1")
        r = subprocess.run(TRACE + [arg, value, "--duration", "0.6"], capture_output=True, text=True, timeout=180)
    finally:
        holder.kill()
        holder.wait()
    assert r.returncode == 0, r.stderr[-2000:]
    snaps = [json.loads(line) for line in r.stdout.splitlines()]
    want = "waiting" if arg == "--pid" else "driver"
    assert {s["mode"] for s in snaps} == {want}
    assert not [n for s in snaps for n in s["notes"] if n.startswith("demo:")]
    assert demo_workers() == []



def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""
