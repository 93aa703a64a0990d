"""stall.py without root: the freezer backends against fake cgroup directories (a thread plays
the kernel), the choice of backend, and SignalStopper's reading of a fake /proc. The few real
processes here are our own children, which we may signal without root."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from convgpu.enforcer.tenants.cgroupfs import Layout
from convgpu.enforcer.failsafe.stall import (FreezerV1, FreezerV2, SignalStopper, StallError, Target,
                                    detect, make_stopper, v2_has_freeze)
from convgpu.errors import ConvgpuError

CG = "/machine/ctr"
T = Target(cgroup=CG)


def write(path, text):
    with open(path, "w") as f:
        f.write(text)


def read(path):
    with open(path) as f:
        return f.read()


@pytest.fixture
def v2(tmp_path):
    root = tmp_path / "v2"
    d = root / CG.strip("/")
    d.mkdir(parents=True)
    write(d / "cgroup.freeze", "0\n")
    write(d / "cgroup.events", "populated 1\nfrozen 0\n")
    return root, d


class Kernel(threading.Thread):
    """Plays the v2 kernel: once cgroup.freeze changes, cgroup.events follows after `delay`."""

    def __init__(self, d, delay=0.01):
        super().__init__(daemon=True)
        self.d, self.delay, self.stop = d, delay, threading.Event()
        self.seen = read(d / "cgroup.freeze").strip()   # before start(): the write may come first

    def run(self):
        seen = self.seen
        while not self.stop.is_set():
            now = read(self.d / "cgroup.freeze").strip()
            if now and now != seen:
                seen = now
                time.sleep(self.delay)
                write(self.d / "cgroup.events", f"populated 1\nfrozen {now}\n")
            time.sleep(0.001)

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.join()


def test_v2_stall_waits_for_frozen_then_resumes(v2):
    root, d = v2
    f = FreezerV2(str(root), timeout=2)
    assert f.name == "freezer-v2" and f.state(T) == "running"
    with Kernel(d, delay=0.05):
        t0 = time.monotonic()
        f.stall(T)
        assert time.monotonic() - t0 >= 0.04   # returned only once the "kernel" said frozen 1
        assert read(d / "cgroup.freeze") == "1" and f.state(T) == "stopped"
        f.stall(T)                              # idempotent
        assert f.state(T) == "stopped"
        f.resume(T)
        assert read(d / "cgroup.freeze") == "0" and f.state(T) == "running"
        f.resume(T)                             # idempotent
        assert f.state(T) == "running"


def test_v2_timeout_thaws_and_raises(v2):
    root, d = v2
    f = FreezerV2(str(root), timeout=0.1)
    with pytest.raises(StallError, match=r"did not freeze within 0\.1 s; .*--stall signal"):
        f.stall(T)   # nothing ever sets frozen 1
    assert read(d / "cgroup.freeze") == "0"
    assert f.state(T) == "running"


def test_v2_vanished_cgroup(v2):
    root, _ = v2
    f = FreezerV2(str(root))
    gone = Target(cgroup="/machine/exited")
    with pytest.raises(StallError, match=r"cgroup /machine/exited is gone"):
        f.stall(gone)
    f.resume(gone)   # no error
    assert f.state(gone) == "gone"


def test_v2_refuses_root_and_missing_cgroup(v2):
    root, _ = v2
    f = FreezerV2(str(root))
    for t in (Target(cgroup="/"), Target(cgroup="/../.."), Target(cgroup="")):
        with pytest.raises(StallError):
            f.stall(t)
    with pytest.raises(StallError, match="needs the container's cgroup"):
        f.stall(Target(pids=(1,)))


def test_v2_path_cannot_leave_root(v2, tmp_path):
    root, _ = v2
    (tmp_path / "outside").mkdir()
    write(tmp_path / "outside" / "cgroup.freeze", "0")
    with pytest.raises(StallError, match="gone"):
        FreezerV2(str(root), timeout=0.05).stall(Target(cgroup="/../outside"))
    assert read(tmp_path / "outside" / "cgroup.freeze") == "0"


@pytest.fixture
def v1(tmp_path):
    root = tmp_path / "freezer"
    d = root / CG.strip("/")
    d.mkdir(parents=True)
    write(d / "freezer.state", "THAWED\n")
    return root, d


def freezing_v1(f, d, after=None):
    """Make a write of FROZEN show FREEZING, as the kernel does until every task froze; with
    `after`, a thread completes the freeze after that many seconds."""
    real = f._write

    def fake(path, value):
        real(path, "FREEZING" if value == "FROZEN" else value)
        if value == "FROZEN" and after is not None:
            threading.Timer(after, write, (d / "freezer.state", "FROZEN\n")).start()
    f._write = fake


def test_v1_passes_through_freezing(v1):
    root, d = v1
    f = FreezerV1(str(root), timeout=2)
    assert f.name == "freezer-v1" and f.state(T) == "running"
    freezing_v1(f, d, after=0.05)
    t0 = time.monotonic()
    f.stall(T)
    assert time.monotonic() - t0 >= 0.04
    assert f.state(T) == "stopped"
    f.resume(T)
    assert read(d / "freezer.state") == "THAWED" and f.state(T) == "running"
    f.resume(T)


def test_v1_timeout_thaws_and_raises(v1):
    root, d = v1
    f = FreezerV1(str(root), timeout=0.1)
    freezing_v1(f, d)   # stays FREEZING (a task stuck in the kernel)
    with pytest.raises(StallError, match="did not freeze"):
        f.stall(T)
    assert read(d / "freezer.state") == "THAWED"


def test_v1_vanished_cgroup(v1):
    root, _ = v1
    f = FreezerV1(str(root))
    gone = Target(cgroup="/machine/exited")
    with pytest.raises(StallError, match="is gone"):
        f.stall(gone)
    f.resume(gone)
    assert f.state(gone) == "gone"


def test_make_stopper_choices(tmp_path, monkeypatch):
    v2root, v1root = tmp_path / "unified", tmp_path / "freezer"
    (v2root / "child").mkdir(parents=True)
    v1root.mkdir()
    assert make_stopper("signal", Layout("v1", None, None)).name == "signal"
    # a v2 hierarchy without cgroup.freeze (kernel < 5.2): the v1 freezer
    s = make_stopper("freezer", Layout("hybrid", str(v2root), str(v1root)))
    assert isinstance(s, FreezerV1) and s.root == str(v1root)
    write(v2root / "child" / "cgroup.freeze", "0")
    s = make_stopper("freezer", Layout("hybrid", str(v2root), str(v1root)), timeout=0.5)
    assert isinstance(s, FreezerV2) and s.root == str(v2root) and s.timeout == 0.5
    with pytest.raises(ConvgpuError, match=r"no cgroup freezer on this host \(v1 cgroups\); use --stall signal"):
        make_stopper("freezer", Layout("v1", None, None))
    # an explicit choice: only that one
    assert isinstance(make_stopper("freezer-v1", Layout("hybrid", str(v2root), str(v1root))), FreezerV1)
    with pytest.raises(ConvgpuError, match=r"no cgroup freezer-v2 on this host"):
        make_stopper("freezer-v2", Layout("v1", None, str(v1root)))
    with pytest.raises(ConvgpuError, match="no cgroup freezer"):
        make_stopper("freezer", Layout("v1", None, str(tmp_path / "not-mounted")))
    with pytest.raises(ConvgpuError, match=r"'pause'.*signal, freezer"):
        make_stopper("pause", Layout("v1", None, None))


def test_v2_freeze_by_kernel_version_when_no_child(tmp_path, monkeypatch):
    (tmp_path / "cgroup.procs").write_text("")
    for release, want in (("5.1.0", False), ("5.2.0-1-amd64", True), ("6.18.44-fc", True)):
        monkeypatch.setattr(os, "uname", lambda r=release: os.uname_result(("Linux", "h", r, "", "")))
        assert v2_has_freeze(str(tmp_path)) is want
    assert v2_has_freeze(str(tmp_path / "missing")) is False


def test_detect_given_and_cached():
    lay = Layout("v1", None, None)
    assert detect(lay) is lay
    assert detect() is detect()


def stat_line(pid, state, comm="python3", start=4242):
    rest = ["1", "1", "1", "0", "-1", "4194560"] + ["0"] * 13 + [str(start)] + ["0"] * 30
    return f"{pid} ({comm}) {state} " + " ".join(rest) + "\n"


@pytest.fixture
def proc(tmp_path):
    def put(pid, state, comm="python3"):
        (tmp_path / str(pid)).mkdir(exist_ok=True)
        write(tmp_path / str(pid) / "stat", stat_line(pid, state, comm))
    put.root = str(tmp_path)
    return put


def test_signal_state_from_proc(proc):
    s = SignalStopper(proc=proc.root)
    proc(101, "R")
    proc(102, "T", comm="evil) R (name")   # comm may contain ") R ("
    proc(103, "t")
    proc(104, "Z")
    proc(105, "S")
    assert s.name == "signal"
    assert s.state(Target(pids=(101,))) == "running"
    assert s.state(Target(pids=(105,))) == "running"
    assert s.state(Target(pids=(102,))) == "stopped"
    assert s.state(Target(pids=(102, 103))) == "stopped"
    assert s.state(Target(pids=(102, 999))) == "stopped"   # a vanished pid does not count
    assert s.state(Target(pids=(102, 101))) == "running"   # not all stopped
    assert s.state(Target(pids=(104,))) == "gone"          # a zombie has exited
    assert s.state(Target(pids=(999, 998))) == "gone"
    assert s.state(Target(pids=())) == "gone"
    assert s.escaped(Target(pids=(101,))) is False         # never stalled by us


@pytest.fixture
def child():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield p
    p.kill()
    p.wait()


def test_signal_escape_of_own_child(child):
    s = SignalStopper()
    t = Target(pids=(child.pid,))
    s.stall(t)
    s.stall(t)   # idempotent
    assert s.state(t) == "stopped" and not s.escaped(t)
    os.kill(child.pid, signal.SIGCONT)   # someone else resumes it
    deadline = time.monotonic() + 2
    while not s.escaped(t) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert s.escaped(t) and s.state(t) == "running"
    s.resume(t)
    assert not s.escaped(t)   # resumed by us: no longer ours to watch
    s.resume(t)
    child.kill()
    child.wait()
    assert s.state(t) == "gone"
    s.resume(t)   # a vanished pid is no error
    with pytest.raises(StallError, match="alive to stall"):
        s.stall(t)
