"""stall.py against the real kernel: busy processes in real cgroups, stopped by signals, the v2
freezer and the v1 freezer. CPU time (utime+stime of /proc/<pid>/stat) is the proof that a
process does or does not run. Latencies are printed (pytest -s), not asserted."""
from __future__ import annotations

import os
import signal
import statistics
import subprocess
import time
from pathlib import Path

import pytest

from conftest import need, remove_cgroup
from convgpu.enforcer.tenants.containers import cgroup_layout
from convgpu.enforcer.failsafe.stall import (FreezerV1, FreezerV2, SignalStopper, StallError, Target,
                                    make_stopper, v2_has_freeze)

pytestmark = pytest.mark.system

WINDOW = 0.2   # seconds a stopped process must not run / a running one must
BUSY = "while :; do :; done"


def cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])   # fields 14 utime, 15 stime


def proc_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def ran(pid: int, window: float = WINDOW) -> int:
    """Clock ticks of CPU the process used during `window` seconds."""
    before = cpu_ticks(pid)
    time.sleep(window)
    return cpu_ticks(pid) - before


def external_cont(pid: int) -> None:
    """SIGCONT from another process, as a container's own shell or a sibling could send."""
    subprocess.run(["kill", "-CONT", str(pid)], check=True)


def latency(stopper, target, n=20) -> str:
    frz, thaw = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        stopper.stall(target)
        t1 = time.perf_counter()
        stopper.resume(target)
        t2 = time.perf_counter()
        frz.append((t1 - t0) * 1e3)
        thaw.append((t2 - t1) * 1e3)
    return (f"{stopper.name}: stall median {statistics.median(frz):.3f} ms max {max(frz):.3f} ms;"
            f" resume median {statistics.median(thaw):.3f} ms max {max(thaw):.3f} ms")


@pytest.fixture(scope="module")
def layout(root):
    return cgroup_layout()


@pytest.fixture
def hierarchy(request, layout):
    """(stopper, root dir) of the freezer named by the test's parameter."""
    if request.param == "v2":
        if layout.mode == "v1":
            pytest.skip("a cgroup v1 host has no cgroup2 freezer")
        need(layout.v2_root is not None and v2_has_freeze(layout.v2_root),
             "no cgroup2 hierarchy with cgroup.freeze (kernel >= 5.2)")
        return FreezerV2(layout.v2_root), Path(layout.v2_root)
    if layout.mode == "v2":   # by design, not a broken set-up: skip even when tests must run
        pytest.skip("a pure cgroup2 host has no v1 freezer")
    need(layout.freezer_v1_root is not None, "no v1 freezer hierarchy mounted")
    return FreezerV1(layout.freezer_v1_root), Path(layout.freezer_v1_root)


@pytest.fixture
def busy(hierarchy):
    """busy(name) -> (Target, Popen): a busy shell inside a fresh cgroup of the hierarchy.
    Teardown thaws (a v1-frozen task cannot die before), kills, then removes the cgroups."""
    stopper, root = hierarchy
    made: list[tuple[Path, subprocess.Popen | None]] = []

    def make(name="ctr", start=True):
        rel = f"/convgpu-stall-{os.getpid()}-{name}"
        d = root / rel[1:]
        d.mkdir()
        p = None
        if start:
            p = subprocess.Popen(["/bin/sh", "-c", f"echo $$ > {d}/cgroup.procs && {BUSY}"])
            made.append((d, p))
            deadline = time.monotonic() + 5
            while str(p.pid) not in (d / "cgroup.procs").read_text().split():
                assert p.poll() is None and time.monotonic() < deadline, "did not join its cgroup"
                time.sleep(0.005)
        else:
            made.append((d, None))
        return Target(pids=(p.pid,) if p else (), cgroup=rel), p

    yield make
    for d, p in made:
        if isinstance(stopper, FreezerV1) and d.exists():
            (d / "freezer.state").write_text("THAWED")
        if p is not None:
            p.kill()
            p.wait(timeout=10)
        remove_cgroup(d)


@pytest.fixture
def busy_proc():
    p = subprocess.Popen(["/bin/sh", "-c", BUSY])
    yield p
    p.kill()
    p.wait(timeout=10)


def test_signal_stall_resume_and_escape(root, busy_proc):
    s = SignalStopper()
    pid = busy_proc.pid
    t = Target(pids=(pid,))
    assert ran(pid) > 0 and s.state(t) == "running"
    s.stall(t)
    assert proc_state(pid) == "T" and s.state(t) == "stopped"
    assert ran(pid) == 0
    assert not s.escaped(t)
    s.resume(t)
    assert ran(pid) > 0 and s.state(t) == "running"
    s.stall(t)
    external_cont(pid)   # SIGSTOP is advisory: anyone who may signal it can undo it
    deadline = time.monotonic() + 2
    while not s.escaped(t) and time.monotonic() < deadline:
        time.sleep(0.002)
    assert s.escaped(t) and ran(pid) > 0
    s.resume(t)
    assert not s.escaped(t)
    print("\n" + latency(s, t))


@pytest.mark.parametrize("hierarchy", ["v2", "v1"], indirect=True)
def test_freezer_stall_is_immune_to_sigcont(hierarchy, busy):
    stopper, _ = hierarchy
    t, p = busy()
    assert ran(p.pid) > 0 and stopper.state(t) == "running"
    stopper.stall(t)
    assert stopper.state(t) == "stopped"
    print(f"\n{stopper.name}: /proc state of a frozen task: {proc_state(p.pid)}")
    assert ran(p.pid) == 0
    external_cont(p.pid)   # does not undo the freezer
    assert ran(p.pid) == 0 and stopper.state(t) == "stopped"
    stopper.stall(t)       # idempotent
    assert stopper.state(t) == "stopped"
    stopper.resume(t)
    assert stopper.state(t) == "running" and ran(p.pid) > 0
    stopper.resume(t)      # idempotent
    assert stopper.state(t) == "running" and ran(p.pid) > 0
    print(latency(stopper, t))


@pytest.mark.parametrize("hierarchy", ["v2", "v1"], indirect=True)
def test_freezer_vanished_cgroup(hierarchy, busy):
    stopper, root = hierarchy
    t, _ = busy("gone", start=False)
    (root / t.cgroup[1:]).rmdir()
    assert stopper.state(t) == "gone"
    with pytest.raises(StallError, match=rf"cgroup {t.cgroup} is gone.*container has exited"):
        stopper.stall(t)
    stopper.resume(t)   # no exception
    assert stopper.state(t) == "gone"


@pytest.mark.parametrize("hierarchy", ["v2", "v1"], indirect=True)
def test_kill_while_frozen(hierarchy, busy):
    """Why stall.py says to resume after killing a v1-stalled container."""
    stopper, _ = hierarchy
    t, p = busy()
    stopper.stall(t)
    p.send_signal(signal.SIGKILL)
    if isinstance(stopper, FreezerV2):
        p.wait(timeout=2)   # dies at once, frozen or not
    else:
        time.sleep(WINDOW)
        assert p.poll() is None, "a v1-frozen task should not die before thaw"
        stopper.resume(t)
        p.wait(timeout=2)
    stopper.resume(t)


def test_make_stopper_freezer_on_this_host(layout):
    need(layout.v2_root is not None or layout.freezer_v1_root is not None, "no freezer")
    s = make_stopper("freezer", layout)
    print(f"\n{layout.mode} host: --stall freezer uses {s.name} at {s.root}")
    assert s.name in ("freezer-v2", "freezer-v1")
