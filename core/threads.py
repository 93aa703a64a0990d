"""Threads named in the kernel as well: /proc/PID/task/TID/comm, `top -H`, `ps -L` and a
benchmark's CPU and wake-ups per thread (bench/breakdown.py) then say which of the enforcer's
threads it is. Python 3.12 names only its own object, and every thread showed as `python3`."""
import ctypes
import threading

PR_SET_NAME = 15            # prctl(2): the calling thread's name, 15 bytes and a NUL
_libc = ctypes.CDLL(None, use_errno=True)


class Thread(threading.Thread):
    """threading.Thread whose kernel name is its `name` (cut to 15 bytes) once it runs."""

    def run(self):
        _libc.prctl(PR_SET_NAME, self.name.encode()[:15], 0, 0, 0)
        super().run()
