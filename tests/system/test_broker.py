"""The enforcer's side of the preload shim (enforcer/serving/broker.py) with real probes: a shim process
is accounted by BPF (its direct calls, outside the shim's wrappers, are admitted like anyone's:
tests/security/test_row2_hello_is_not_the_shim.py); asks are granted, made to wait (only that caller) and
woken by the scheduler, or denied above the limit. In-process enforcer on the stand-in driver."""
import subprocess
import time

import pytest

from conftest import GiB, inprocess_enforcer, read_until

pytestmark = pytest.mark.system


@pytest.fixture
def enforcer(root, build):
    enf = inprocess_enforcer(build / "standin" / "libcuda.so.1", "broker", 3 * GiB)
    enf.start()
    yield enf
    enf.close()


def joined(pid, cg):
    """True once pid has moved itself into cgroup directory cg."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if open(f"/proc/{pid}/cgroup").read().strip().endswith(cg.name):
            return True
        time.sleep(0.01)
    return False


def run_until(enf, cond, timeout=20):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        enf.step()
        if cond():
            return
        time.sleep(0.01)
    raise AssertionError("condition not reached")


def test_shim_process_is_accounted_never_stopped_and_asks(enforcer, cgroups, build, caller_env):
    enf = enforcer
    cg = cgroups("shimmed")
    # hello first (while it sleeps), then it allocates its whole 3 GiB assignment (directly: no
    # shim wrapper, so admitted like anyone's, and it fits); the bytes are charged
    p = subprocess.Popen(["/bin/sh", "-c", f'echo $$ > {cg}/cgroup.procs && sleep 1 && exec "$0" "$@"',
                          str(build / "cgcaller"), "alloc", "-n", "6", "-s", str(GiB // 2), "--hold"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=caller_env)
    try:
        b = enf.broker
        assert joined(p.pid, cg)
        hello, page = b.shim_hello(p.pid)
        assert hello == {"limit": 3 * GiB, "devices": {"0": 3 * GiB}, "credit": b.credit.pages[p.pid].id}
        assert page == b.credit.pages[p.pid].fd
        box = enf.books.pid_box[p.pid]
        run_until(enf, lambda: enf.books.usage(box, 0)[0] == 3 * GiB)   # placed at its first (direct) call
        read_until(p, "ready")
        assert p.pid not in enf.books.shimmed and not box.waiting   # BPF stopped it: "caught", a plain process now
        # above the limit: a real "no" (the shim returns out-of-memory)
        assert "above its limit 3.0 GiB" in b.shim_ask(p.pid, 0, GiB, lambda a: None)["deny"]
        assert b.shim_meminfo(p.pid, 0) == (3 * GiB, 3 * GiB)   # used is capped at the total
        # a second shim process of the same container keeps it alive when p frees and exits
        s = subprocess.Popen(["/bin/sh", "-c", f"echo $$ > {cg}/cgroup.procs && exec sleep 60"])
        assert joined(s.pid, cg)
        b.shim_hello(s.pid)
        p.stdin.write("\n")                                   # frees everything and exits
        p.stdin.flush()
        read_until(p, "freed")
        run_until(enf, lambda: enf.books.usage(box, 0)[0] == 0 and p.pid not in enf.books.pid_box)
        assert enf.books.pid_box[s.pid] is box
        # within the assignment: granted and held as pending until the shim reports it, with
        # half of what is left as credit (pending too, but not "used" to the memory query)
        assert b.shim_ask(s.pid, 0, 2 * GiB, lambda a: None) == {"grant": True}
        assert box.shim_pending == {0: 2 * GiB + GiB // 2} and b.unspent(box, 0) == GiB // 2
        assert b.shim_meminfo(s.pid, 0) == (3 * GiB, 2 * GiB)
        # above the assignment, within the limit, while another container holds the rest: wait
        other = subprocess.Popen(["/bin/sh", "-c", f'echo $$ > {cgroups("other")}/cgroup.procs && exec "$0" "$@"',
                                  str(build / "cgcaller"), "alloc", "-n", "1", "-s", str(GiB), "--hold"],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, env=caller_env)
        run_until(enf, lambda: other.pid in enf.books.pid_box and not enf.books.pid_box[other.pid].waiting)
        read_until(other, "ready")
        enf.runtime.set_limit("shimmed", 4 * GiB)                     # assigned stays 3 GiB: all there is
        assert box.shim_pending == {0: 2 * GiB} and b.unspent(box, 0) == 0   # credit taken back
        answers = []
        assert b.shim_ask(s.pid, 0, GiB + GiB // 2, answers.append) is None and answers == []
        assert box.waiting[0].wakes and box.assigned[0] == 3 * GiB
        other.stdin.write("\n")                               # its 1 GiB comes back
        other.stdin.flush()
        run_until(enf, lambda: answers == [{"grant": True}])
        assert box.assigned[0] == 4 * GiB and 0 not in box.waiting
        assert box.shim_pending == {0: 3 * GiB + GiB // 2 + GiB // 4}   # 1/4 GiB: credit
        b.shim_alloc(s.pid, 0, 0x1000, 2 * GiB)               # reported: no longer pending
        assert box.shim_pending == {0: GiB + GiB // 2 + GiB // 4}
        b.shim_gone(s.pid)
        assert box.shim_pending == {0: 0} and s.pid not in enf.books.shimmed
        s.kill()
        s.wait()
        other.kill()
        other.wait()
    finally:
        p.kill()
        p.wait()


def test_an_exit_whose_pidfd_never_fires_is_given_up(enforcer, cgroups, monkeypatch):
    """An exit's bytes are held against the card until the process's pidfd fires (its files
    closed, its device memory freed); a pid reused in between never fires it, so the hold ends
    after EXIT_WAIT all the same. It leaves its container at once."""
    from convgpu.enforcer import exits
    monkeypatch.setattr(exits, "EXIT_WAIT", 0.2)
    enf, cg = enforcer, cgroups("reused")
    s = subprocess.Popen(["/bin/sh", "-c", f"echo $$ > {cg}/cgroup.procs && exec sleep 60"])
    try:
        assert joined(s.pid, cg)
        enf.placement.join(enf.placement.box_for(s.pid), s.pid, 0)   # placed: a member of its container on GPU0
        enf.exits.exiting(s.pid, GiB)                 # alive (as a reused pid would be): held
        assert s.pid not in enf.books.pid_box and enf.books.tearing(0) == GiB
        enf.step()
        assert enf.books.tearing(0) == GiB
        time.sleep(0.3)
        enf.step()
        assert enf.books.tearing(0) == 0 and not enf.books.exits
    finally:
        s.kill()
        s.wait()
