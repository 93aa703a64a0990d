"""Issue 24, row 3: a FIFO named libcuda.so.1, opened by nobody while a writer comes and goes.
Before: discovery stopped the opener, then bcc's symbol lookup opened the FIFO by path and
blocked for ever; the enforcer's loop hung (no status, no resumes), its heartbeat thread kept
BPF admitting for 30 s, then admission failed open while discovery kept stopping every process
that opened libcuda. Now the FIFO is opened non-blocking, seen not to be a regular file and
its opener let go; and a loop that does hang stops stopping anyone (it follows its beat)."""
import ctypes as ct
import os
import shutil
import subprocess
import sys
import time

import pytest

from attack import as_nobody, scratch  # noqa: F401
from conftest import Enforcing, lines_until, proc_state, stop_all

pytestmark = [pytest.mark.system, pytest.mark.exclusive]   # discovery reaches every driver file on the host

# Opens path read-only; for a FIFO that returns once a writer has come (and gone).
OPEN = "import os,sys; fd=os.open(sys.argv[1], os.O_RDONLY); print('opened', flush=True); sys.stdin.readline()"
WRITER = "import sys,time; f=open(sys.argv[1],'wb'); time.sleep(0.2); f.close()"


def heartbeat_age(run_dir: str) -> float:
    """Seconds since the enforcer's last heartbeat, from its pinned `control` map (struct
    cg_control starts with heartbeat_ns, bpf_ktime_get_ns = CLOCK_MONOTONIC)."""
    from convgpu.enforcer.failsafe.takeover import pin_dir_for
    libc = ct.CDLL(None, use_errno=True)
    path = ct.create_string_buffer(f"{pin_dir_for(run_dir)}/control".encode())
    attr = (ct.c_uint64 * 4)(ct.addressof(path), 0, 0, 0)            # BPF_OBJ_GET: pathname
    fd = libc.syscall(321, 7, attr, 32)
    assert fd >= 0, os.strerror(ct.get_errno())
    try:
        key, value = ct.c_uint32(0), (ct.c_uint64 * 8)()
        attr = (ct.c_uint64 * 4)(fd, ct.addressof(key), ct.addressof(value), 0)   # BPF_MAP_LOOKUP_ELEM
        assert libc.syscall(321, 1, attr, 32) == 0, os.strerror(ct.get_errno())
        return (time.monotonic_ns() - value[0]) / 1e9
    finally:
        os.close(fd)


def _opened(p, timeout):
    out: list = []
    lines_until(p.stdout, lambda line: line == "opened", out, timeout, "opener")


def test_row03_fifo_named_libcuda_keeps_the_loop_beating(root, build, scratch):
    fifo = scratch / "attacker" / "libcuda.so.1"
    subprocess.run(as_nobody("mkfifo", fifo), check=True)
    enf = Enforcing(build, "--gpu-memory", "1GiB", "--discover", start_timeout=120)
    procs = []
    try:
        opener = subprocess.Popen(as_nobody(sys.executable, "-c", OPEN, fifo), stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/")
        procs.append(opener)
        for _ in range(3):          # the writer comes and goes; the opener's open returns on the first
            subprocess.run(as_nobody(sys.executable, "-c", WRITER, fifo), timeout=30, cwd="/")
            time.sleep(0.3)
        _opened(opener, 10)                             # let go: a FIFO cannot hold code
        assert proc_state(opener.pid) != "T"
        enf.wait_for(f"pid {opener.pid} opened {fifo}: a FIFO, not a regular file; not a driver, let go", 10)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 5:                # the loop runs: status answers, beats fresh
            t = time.monotonic()
            st = enf.ctl(cmd="status")["status"]
            assert time.monotonic() - t < 2 and st["discovery"]["on"]
            assert heartbeat_age(enf.run_dir) < 1.0
            time.sleep(0.5)
        # stopped once, at its one open (the writers open for writing: never stopped); other
        # processes of this host may be stopped at files of their own: only ours count
        assert st["discovery"]["recent"].count(opener.pid) == 1, st["discovery"]
        assert [u for u in st["unprobed"] if u["pid"] == opener.pid] == []
        # discovery still works: a real driver copy opened now stops its opener, which is let go
        # once the copy is probed ("probes attached" lines are one per container: not counted)
        copy = scratch / "attacker" / "copy" / "libcuda.so.1"
        copy.parent.mkdir()
        shutil.copy(build / "standin" / "libcuda.so.1", copy)
        ok = subprocess.Popen([sys.executable, "-c", OPEN, copy], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
        procs.append(ok)
        _opened(ok, 20)
        after = enf.ctl(cmd="status")["status"]
        assert after["discovery"]["recent"].count(ok.pid) == 1, after["discovery"]
    finally:
        stop_all(procs)
        if enf.p.poll() is None:    # before: blocked in open(); a writer lets it out
            w = subprocess.Popen(as_nobody(sys.executable, "-c", WRITER, fifo), cwd="/")
            enf.close()
            w.kill()
            w.wait()


def test_row03_a_hung_loop_stops_no_one_at_open(root, build, scratch):
    """The tracer's loop makes no pass for 4 s (hung): a process already held at its open of a
    driver copy is let go, and one that opens another copy meanwhile is not stopped at all;
    once the loop runs again, discovery stops (and probes) the next one as before."""
    from convgpu.probes.tracer import Tracer
    copies = []
    for i in range(3):
        d = scratch / "attacker" / f"c{i}"
        d.mkdir()
        shutil.copy(build / "standin" / "libcuda.so.1", d / "libcuda.so.1")
        copies.append(d / "libcuda.so.1")
    procs = []

    def opener(path):
        p = subprocess.Popen(as_nobody(sys.executable, "-c", OPEN, path), stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/")
        procs.append(p)
        return p

    t = Tracer(discover=True, rescan_every=3600).start()
    try:
        t.enable_discovery()
        t.poll()
        a = opener(copies[0])       # held at its open: nobody polls from here on
        deadline = time.monotonic() + 10
        while not t.discovery.held.listed() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert t.discovery.held.listed(), "the first opener was not held"
        time.sleep(4.0)
        _opened(a, 5)               # let go by the sentinel
        b = opener(copies[1])
        _opened(b, 3)               # never stopped: BPF saw a stale beat
        t.poll()                    # the loop runs again
        c = opener(copies[2])
        deadline = time.monotonic() + 10
        probed = lambda: os.stat(copies[2]).st_ino in {lib.inode[1] for lib in t.libraries}  # noqa: E731
        while not (c.pid in t.discovery.recent and probed()) and time.monotonic() < deadline:
            t.poll()                # (a copy is read off the loop: attached a pass or more later)
            time.sleep(0.05)
        _opened(c, 5)
        t.poll()
        # (other processes of this host that open a driver are stopped too: counted by pid)
        assert a.pid in t.discovery.recent and b.pid not in t.discovery.recent and c.pid in t.discovery.recent
        assert os.stat(copies[2]).st_ino in {lib.inode[1] for lib in t.libraries}
    finally:
        stop_all(procs)
        t.close()
