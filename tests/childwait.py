"""A test's wait for its child never takes a stop that belongs to the in-process enforcer.

The suite runs enforcers in the test's own process (conftest.inprocess_enforcer), so the thread
holder (enforcer/failsafe/threadhold.py) traces children that a test thread started. The kernel
then reports the tracee's ptrace-stops to *any* thread of the group that waits for it, with no
WUNTRACED asked ("traced by its real parent's group": kernel/exit.c, wait_consider_task). A
test's `Popen.poll()` that came first took the holder's stop: Python read it as the child's end
(returncode -19, CI of 2026-12-06), and the holder never saw the thread stop.

So before subprocess's waitpid, a peek (waitid with WNOWAIT leaves the status where it is):
only an exit is reaped; a stop stays for the holder and reads as still running. The daemon
never traces its own children, so this concerns the tests alone."""
import os
import subprocess
import time

ENDED = (os.CLD_EXITED, os.CLD_KILLED, os.CLD_DUMPED)


def _ended(pid: int, block: bool = False) -> bool:
    """pid's exit is waiting to be reaped (or it is no child of ours: subprocess handles that).
    Blocking, it returns at pid's next status, exit or stop."""
    try:
        got = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT | (0 if block else os.WNOHANG))
    except ChildProcessError:
        return True
    return got is not None and got.si_code in ENDED


def install():
    poll, try_wait = subprocess.Popen._internal_poll, subprocess.Popen._try_wait

    def _internal_poll(self, *a, **kw):
        try:
            running = self.returncode is None and not _ended(self.pid)
        except Exception:    # called by __del__, maybe at interpreter exit: subprocess's own way
            running = False
        return None if running else poll(self, *a, **kw)

    def _try_wait(self, wait_flags):
        # a blocking wait sleeps in the kernel until the exit, as subprocess's own: the holder
        # also waits for a traced child, and whoever comes first reaps it (a late one: ECHILD)
        while not _ended(self.pid, block=not wait_flags & os.WNOHANG):
            if wait_flags & os.WNOHANG:
                return (0, 0)
            time.sleep(0.002)    # stopped: its stop stays reportable, so a blocking peek returns at once
        return try_wait(self, wait_flags)

    subprocess.Popen._internal_poll, subprocess.Popen._try_wait = _internal_poll, _try_wait
