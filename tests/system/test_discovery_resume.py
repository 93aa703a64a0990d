"""Nobody stopped by discovery stays stopped (probes/discovery.py): a process stopped at its open
of a driver file is resumed on every way out. Seen twice before this: a pytest worker, and a
bench process, left in state T (a group stop, no tracer) after opening a libcuda.so.1 while an
enforcer with discovery on ran, the whole suite standing still behind them. Cause: a thread
that closed the file and opened it again at once got the same fd, so BPF's `held` entry of its
second stop equalled the first's; the resume of the first deleted it, and the second stop's
event was then taken for a stale one. Each stop's `held` value now carries a stamp."""
import subprocess
import sys
import threading
import time

import pytest

from conftest import lines_until, proc_state, until, wait_state

pytestmark = [pytest.mark.system, pytest.mark.exclusive]   # discovery reaches every driver file on the host

# opens and closes the driver file N times (the lowest free fd: the same one each time), then
# says which fds it got
REOPEN = ("import os, sys\nfds = set()\nfor _ in range(int(sys.argv[2])):\n"
          "    fd = os.open(sys.argv[1], os.O_RDONLY)\n    fds.add(fd)\n    os.close(fd)\n"
          "print('done', *sorted(fds), flush=True)\nsys.stdin.readline()\n")
OPENER = "import sys; open(sys.argv[1], 'rb').read(); print('opened', flush=True); sys.stdin.readline()"


class Discovering:
    """An in-process tracer with discovery on (this process is its own, never stopped), its
    loop on a thread as trace's and enforce's run it. `dropping`: the next stop's event is
    lost on its way (as when the ring buffer is full). --unprobed: on_unprobed."""

    def __init__(self, lib, on_unprobed=None):
        from convgpu.probes.tracer import Tracer
        self.t = t = Tracer(libraries=(str(lib),), discover=True, rescan_every=3600, selftest=False).start()
        if on_unprobed is not None:
            t.discovery.on_unprobed = on_unprobed
        real, self.dropped, self.dropping = t.discovery.opened, [], False

        def opened(pid, tid, fd):
            if self.dropping:
                self.dropping = False
                self.dropped.append(pid)
                return
            real(pid, tid, fd)
        t.discovery.opened = opened
        t.enable_discovery()
        self.done = threading.Event()
        self.th = threading.Thread(target=self._loop, daemon=True)
        self.th.start()

    def _loop(self):
        while not self.done.is_set():
            self.t.wait(0.05)
            self.t.poll()

    def stop(self):
        """As trace and enforce end: the loop first, then the tracer (discovery off, every
        process it holds resumed)."""
        if not self.done.is_set():
            self.done.set()
            self.th.join(timeout=10)
            self.t.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def line_of(p, timeout=30) -> list[str]:
    """p's next line, split; fails (not hangs) if a stopped p never writes it."""
    sink: list[str] = []
    try:
        return lines_until(p.stdout, lambda line: True, sink, timeout, f"pid {p.pid}").split()
    except AssertionError as e:
        raise AssertionError(f"{e}; its state {proc_state(p.pid) if p.poll() is None else p.returncode}") from None


def stall(pid, lib, why):
    return "stall"


@pytest.fixture(scope="module")
def shared(root, build):
    """One tracer for the tests that do not end it (a start costs seconds of an exclusive turn)."""
    with Discovering(build / "standin" / "libcuda.so.1", on_unprobed=stall) as d:
        yield d


def held_of(t, pid) -> list[int]:
    return [k.value for k in t.b[b"held"].keys() if k.value >> 32 == pid]


def test_a_driver_file_opened_again_at_once_at_the_same_fd_is_resumed_every_time(build, shared):
    """50 opens of the stand-in by one thread, each at the same fd right after the last close:
    stopped at each (exactly 50 stops of it), resumed at each, nothing left in `held`. Before
    the stamp it stayed stopped at the second or a later open, for good (the tracer's close
    did not resume it either)."""
    d, lib = shared, build / "standin" / "libcuda.so.1"
    p = subprocess.Popen([sys.executable, "-c", REOPEN, str(lib), "50"], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        done, *fds = line_of(p)
        assert done == "done" and len(fds) == 1     # one fd, 50 times
        assert list(d.t.discovery.recent).count(p.pid) == 50
        # SIGCONT comes before the entry's delete (probes/held.py resume): the opener may say
        # "done" a moment before its last entry goes
        until(lambda: held_of(d.t, p.pid) == [], 5, "its held entries gone")
    finally:
        p.kill()
        p.wait()


def test_a_stop_whose_event_was_lost_is_resumed(build, shared):
    """The first stop's event never reaches the loop (a full ring buffer): the stop is found in
    `held`, unchanged for LOST_AFTER_S, and looked at; the opener goes on."""
    from convgpu.probes.held import LOST_AFTER_S
    d, lib = shared, build / "standin" / "libcuda.so.1"
    lost = d.t.discovery.lost_events
    d.dropping = True
    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, "-c", OPENER, str(lib)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        assert line_of(p) == ["opened"]
        took = time.monotonic() - t0
        assert d.dropped == [p.pid] and d.t.discovery.lost_events == lost + 1
        until(lambda: held_of(d.t, p.pid) == [], 5, "its held entry gone (deleted after the SIGCONT)")
        assert took >= LOST_AFTER_S, took   # not resumed by anything but the look for lost stops
    finally:
        p.kill()
        p.wait()


@pytest.fixture
def not_a_driver(tmp_path):
    """Named like the driver, cannot be probed (a 32-bit ELF header): --unprobed stall holds it."""
    d = tmp_path / "bad"
    d.mkdir()
    (d / "libcuda.so.1").write_bytes(b"\x7fELF\x01\x01" + bytes(58))
    return d / "libcuda.so.1"


def test_a_held_opener_that_is_killed_leaves_no_entry(shared, not_a_driver):
    """The opener dies while held: BPF's exit tracepoint drops its `held` entry (nothing for a
    later resume to signal: its pid may be another process's by then)."""
    d = shared
    p = subprocess.Popen([sys.executable, "-c", OPENER, str(not_a_driver)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        until(lambda: p.pid in d.t.discovery.unprobed, 20, "held for its unprobed file")
        assert len(held_of(d.t, p.pid)) == 1
    finally:
        p.kill()
        p.wait()
    assert held_of(d.t, p.pid) == []


def test_a_process_held_for_an_unprobed_file_is_resumed_when_the_tracer_stops(shared, not_a_driver):
    """Held on purpose (--unprobed stall), it stays stopped while the tracer runs, is not taken
    for a lost stop, and goes on when the tracer stops normally (discovery's disable)."""
    from convgpu.probes.held import LOST_AFTER_S
    d = shared
    p = subprocess.Popen([sys.executable, "-c", OPENER, str(not_a_driver)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        until(lambda: p.pid in d.t.discovery.unprobed, 20, "held for its unprobed file")
        wait_state(p.pid, "T")
        looks, lost = d.t.discovery.lost_looks, d.t.discovery.lost_events
        until(lambda: d.t.discovery.lost_looks >= looks + 2, 10 * LOST_AFTER_S, "two looks for lost stops")
        assert d.t.discovery.unprobed[p.pid].action == "stall" and len(held_of(d.t, p.pid)) == 1
        assert d.t.discovery.lost_events == lost and proc_state(p.pid) == "T"
        d.stop()
        assert line_of(p) == ["opened"]
    finally:
        p.kill()
        p.wait()
