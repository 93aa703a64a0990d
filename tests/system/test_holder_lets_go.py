"""A process the ptrace holder seized is detached once nothing of it has been held for LINGER
(enforcer/failsafe/threadhold.py), however its stop ended. Found through issue 32: a process
seized at a stop that was released before the holder saw the thread stop (a placement is
granted within a millisecond) was never detached, and the holder polled it every 0.5 ms for the
rest of its life (on the H100 the enforcer took 3.7-7.5 us of CPU and 0.13-0.2 wake-ups per
allocation of a workload doing nothing but allocate). In-process enforcer on the stand-in,
real probes, real cgroups, a two-thread process placed at its first context."""
import os
import select
import signal
import subprocess
import sys
import time

import pytest

from conftest import GiB, cuda_prelude, inprocess_enforcer, popen_in, proc_state, until

pytestmark = pytest.mark.system
CHILD = """
import threading, time
threading.Thread(target=time.sleep, args=(600,), daemon=True).start()   # a sibling: held alone by ptrace
"""


def tracer_of(pid: int) -> int:
    """Any tracer of any of pid's threads (/proc/PID/status tells the main thread's alone)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                t = int(next(line.split()[1] for line in f if line.startswith("TracerPid:")))
        except OSError:
            continue
        if t:
            return t
    return 0


def test_a_process_placed_at_once_is_let_go(root, build, caller_env, cgroups):
    from convgpu.enforcer.failsafe.threadhold import LINGER
    lib = build / "standin" / "libcuda.so.1"
    enf = inprocess_enforcer(lib, "holder", GiB).start()
    p = None
    try:
        code = CHILD + cuda_prelude(lib) + "print('up', flush=True); sys.stdin.read()\n"
        p = popen_in(cgroups("holder"), sys.executable, "-c", code, env=caller_env)
        until(lambda: (enf.step(), select.select([p.stdout], [], [], 0.01)[0])[1], 30, "the child placed")
        line = p.stdout.readline().strip()
        assert line == "up", (line, p.poll(), p.stderr.read() if p.poll() is not None else "")
        assert enf.holds.holder is not None and enf.holds.holder.seized >= 1, "its stop did not go through the holder"
        t0 = time.monotonic()
        until(lambda: (enf.step(), tracer_of(p.pid) == 0)[1], 10 * LINGER + 5, f"pid {p.pid} still traced")
        assert time.monotonic() - t0 < LINGER + 2
        assert p.pid not in enf.holds.holder.traced
    finally:
        if p is not None:
            p.kill()
            p.wait()
        enf.close()


def test_a_held_child_of_the_enforcers_own_process_that_is_killed_keeps_its_status(root):
    """The holder reaped every traced thread's exit, a process's main thread too. Where that
    process is a child of the enforcer's own process (the suite's enforcers run in the test's
    process; the daemon's own children), its parent's wait then found ECHILD, and subprocess
    read the kill as exit status 0. Now the parent's wait reaps it: -9."""
    from convgpu.enforcer.failsafe.threadhold import ThreadHolder
    holder = ThreadHolder(lambda pid, tid: 7 if tid == pid else None).start()
    p = subprocess.Popen([sys.executable, "-c", CHILD + "print('up', flush=True); time.sleep(600)"],
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "up"
        os.kill(p.pid, signal.SIGSTOP)     # BPF's stop at a call
        holder.hold(p.pid, p.pid)          # its main thread alone is held, the sibling runs on
        states = lambda: {int(t): proc_state(f"{p.pid}/task/{t}") for t in os.listdir(f"/proc/{p.pid}/task")}  # noqa: E731
        until(lambda: holder.traced == {p.pid} and states()[p.pid] == "t" and set(states().values()) == {"t", "S"},
              10, "not held by its thread")
        p.kill()
        until(lambda: not holder.traced, 10, "the holder still traces it")   # its exit was seen
        assert p.wait(timeout=10) == -signal.SIGKILL     # before: 0
    finally:
        holder.close()
        if p.returncode is None:
            p.kill()
            p.wait()
