"""Reading a container's files off the loop (issue 33, principle 3).

The enforcer's loop keeps admission alive (its heartbeat, resumes, the status socket): a file
a container brings must not be able to hold it. Issue 33 row 4: a crafted libcuda.so.1 made
`read_symbols` run for minutes on the loop, the heartbeat lapsed and BPF then admitted every
call unchecked. So every read of such a file runs here, on one daemon thread, each job within
its own untrusted.Budget (time and bytes, checked before each read), and the loop only looks
at finished results. A container also has a budget of its own (Spent): past READ_S seconds
of reading in WINDOW_S, its next files are refused unread, so that one tenant cannot keep
this thread from the others' files."""
import collections
import logging
import os
import queue
import threading
import time
from concurrent.futures import Future

from ..threads import Thread

log = logging.getLogger(__name__)
READ_S = 3.0        # seconds of reading one container may cause in WINDOW_S (a real copy: ~50 ms)
WINDOW_S = 60.0


class Reader:
    """One daemon thread that runs jobs in order (a thread, not a pool: a pool's workers are
    joined at exit, and nothing here may keep the daemon from ending)."""

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        # readable once a job is done: the loop sleeps in select() on it with the ring buffer,
        # so a process waiting for its look goes on at once, not at the loop's next tick
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)

    def drain(self) -> None:
        try:
            os.eventfd_read(self.fd)
        except BlockingIOError:
            pass

    def submit(self, fn, *args) -> Future:
        """fn(*args) on the reader's thread; the Future holds its result or its exception."""
        if self._thread is None:
            self._thread = Thread(target=self._run, name="convgpu-reader", daemon=True)
            self._thread.start()
        f: Future = Future()
        self._jobs.put((f, fn, args))
        return f

    def _run(self):
        while True:
            f, fn, args = self._jobs.get()
            if not f.set_running_or_notify_cancel():
                continue
            t0 = time.monotonic()
            try:
                out, err = fn(*args), None
            except BaseException as e:   # the caller decides; this thread never dies of a file
                out, err = None, e
            f.took = time.monotonic() - t0   # before the result: the loop reads it once done
            if err is None:
                f.set_result(out)
            else:
                f.set_exception(err)
            os.eventfd_write(self.fd, 1)


class Spent:
    """Seconds of reading each container caused lately: refuse its next file past READ_S."""

    def __init__(self, limit: float = READ_S, window: float = WINDOW_S):
        self.limit, self.window = limit, window
        self.spent: dict[str, collections.deque] = {}

    def add(self, container: str, seconds: float) -> None:
        now = time.monotonic()
        self.spent.setdefault(container, collections.deque()).append((now, seconds))
        if len(self.spent) > 4096:   # containers come and go (and sub-cgroups): the quiet ones go
            for c in [c for c, d in self.spent.items() if now - d[-1][0] > self.window]:
                del self.spent[c]

    def over(self, container: str) -> bool:
        d = self.spent.get(container)
        if not d:
            return False
        now = time.monotonic()
        while d and now - d[0][0] > self.window:
            d.popleft()
        if not d:
            del self.spent[container]
            return False
        return sum(s for _, s in d) >= self.limit
