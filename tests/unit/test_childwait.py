"""tests/childwait.py: a child that another thread of the test's process traces (as the
in-process enforcer's holder does) reads as running while in its ptrace-stop, the stop stays
for its tracer, and its exit is still reaped with its status. Without the peek, poll() returned
-19 here and the tracer's waitpid found nothing (CI, 2026-12-06)."""
import os
import queue
import signal
import subprocess
import sys
import threading
import time

from convgpu.enforcer.failsafe.threadhold import PTRACE_CONT, PTRACE_SEIZE, WALL, ptrace


def tracer(pid: int, asks: queue.Queue, answers: queue.Queue):
    """One thread does every ptrace call for pid (ptrace is per tracer thread)."""
    answers.put(ptrace(PTRACE_SEIZE, pid))
    while (ask := asks.get()) != "end":
        if ask == "wait":
            deadline, got = time.monotonic() + 10, (0, 0)
            while time.monotonic() < deadline and got[0] == 0:
                got = os.waitpid(pid, os.WNOHANG | WALL)
                time.sleep(0.001)
            answers.put(got[1] if got[0] else None)
        elif ask == "cont":
            answers.put(ptrace(PTRACE_CONT, pid, 0, 0))


def test_a_traced_childs_stop_is_left_to_its_tracer_and_its_exit_reaped():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    asks, answers = queue.Queue(), queue.Queue()
    t = threading.Thread(target=tracer, args=(child.pid, asks, answers), daemon=True)
    t.start()
    try:
        assert answers.get(timeout=10) == 0                      # seized
        os.kill(child.pid, signal.SIGSTOP)                       # a signal-delivery-stop for the tracer
        until = time.monotonic() + 10
        while open(f"/proc/{child.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "t":
            assert time.monotonic() < until, "the child never reached its ptrace-stop"
            time.sleep(0.005)
        assert child.poll() is None                              # before: -19
        try:
            child.wait(timeout=0.2)
            raise AssertionError("wait() returned on a stop")
        except subprocess.TimeoutExpired:
            pass
        asks.put("wait")
        st = answers.get(timeout=15)
        assert st is not None and os.WIFSTOPPED(st) and os.WSTOPSIG(st) == signal.SIGSTOP
        asks.put("cont")                                         # the SIGSTOP suppressed
        assert answers.get(timeout=10) == 0
        assert child.poll() is None
        child.kill()
        assert child.wait(timeout=10) == -signal.SIGKILL
    finally:
        asks.put("end")
        if child.returncode is None:
            child.kill()
            child.wait()
