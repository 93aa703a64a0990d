"""The shim-only ledger (probes/ledger.py): the tables the enforcer reads, kept from shim
reports with BPF's rules (device pages, contexts once per primary, a container charged only
once the enforcer made its entry), and a process's exit seen through its pidfd."""
import ctypes as ct
import subprocess
import time

from convgpu.probes.ledger import SHIM_MEMBER, Ledger, footprint

MiB = 1 << 20


def test_footprint_is_bpfs():
    assert [footprint(s) for s in (4096, MiB, MiB + 1, 3 * MiB, 4 * MiB)] == [4096, MiB, 2 * MiB, 4 * MiB, 4 * MiB]


def exec_done(pid: int, led: Ledger):
    """Waits until pid runs `sleep` (Popen forks, then execs) and the ledger has read that exec:
    under load the exec came after the watch (a fresh clone: an 'exec' event among the test's)."""
    deadline = time.monotonic() + 10
    while open(f"/proc/{pid}/comm").read().strip() != "sleep":
        assert time.monotonic() < deadline, "the child never exec'd sleep"
        time.sleep(0.005)
    led.poll()


def test_reports_charge_the_container_and_an_exit_takes_everything_back():
    led = Ledger().start()
    child = subprocess.Popen(["sleep", "30"])
    try:
        exec_done(child.pid, led)   # its exec, seen after the watch, would be a new image: empty
        cg = led.b[b"cgstate"]
        led.b[b"members"][ct.c_uint(child.pid)] = ct.c_ulonglong(7 | SHIM_MEMBER)
        led.watch(child.pid)
        led.alloc(child.pid, 0, 3 * MiB)                # before the entry: the process only
        cg[cg.Key(container=7, dev=0)] = cg.Leaf()
        led.context(child.pid, 0, primary=True)
        led.context(child.pid, 0, primary=True)         # a second retain costs nothing
        led.context(child.pid, 0, primary=False)
        led.alloc(child.pid, 0, 3 * MiB)
        led.alloc(child.pid, 0, 4096)
        led.free(child.pid, 0, 4096)
        st = cg[cg.Key(container=7, dev=0)]
        assert (st.used, st.contexts) == (4 * MiB, 2)
        (u,) = led.usage()
        assert (u.pid, u.live, u.peak, u.n_alloc, u.n_free, u.contexts) == (child.pid, 8 * MiB, 8 * MiB + 4096, 3, 1, 2)
        assert [e.op for e in led.poll()] == ["alloc", "alloc", "alloc", "free"]
        child.kill()
        child.wait()
        deadline = time.monotonic() + 5
        while not (evs := led.poll()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [(e.op, e.pid, e.size) for e in evs] == [("exit", child.pid, 8 * MiB)]
        assert (st.used, st.contexts) == (0, 0) and led.usage() == [] and child.pid not in led.b[b"members"]
    finally:
        child.kill()
        led.close()
