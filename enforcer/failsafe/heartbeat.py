"""The enforcer's heartbeat in BPF's control map, from a thread of its own.

BPF admits only while the heartbeat is under 2 s old (HEARTBEAT_NS in bpf/admit.bpf.c); then
it fails open, so that no process waits on an enforcer that is gone. Beaten from the loop, a
pass that took 2 s (a self-test child of a library just attached, a state file on a slow disk,
the GIL held) let every process allocate unchecked. The loop still beats while it runs, so that
this thread, in the common case, takes the GIL only to read a clock (the loop's resumes are
what the latency target measures); it beats for a loop that has not for two periods, and only
until the loop has not run for `hung` seconds: a hung enforcer must not hold stalled work for
ever either.
The watchdog turns admission off at once when the enforcer dies; this is the second line."""
import logging
import threading
import time

from ...threads import Thread

log = logging.getLogger(__name__)


class Heartbeat:
    def __init__(self, beat, every: float, hung: float):
        """beat(): writes the control map with a fresh heartbeat; every: s between beats;
        hung: s without a loop pass after which the beats stop."""
        self.beat, self.every, self.hung = beat, every, hung
        self.ran = self.beaten = time.monotonic()
        self._stop = threading.Event()
        self._thread = Thread(target=self._run, name="convgpu-beat", daemon=True)

    def start(self) -> "Heartbeat":
        self._thread.start()
        return self

    def loop_ran(self) -> float:
        """The loop made a pass now; returns the seconds since its previous one."""
        now = time.monotonic()
        gap, self.ran = now - self.ran, now
        return gap

    def beat_if_due(self):
        """From the loop, after the pass's decisions: a beat every `every` s."""
        now = time.monotonic()
        if now - self.beaten >= self.every:
            self.beaten = now
            self.beat()

    def _run(self):
        said = False
        while not self._stop.wait(self.every):
            now = time.monotonic()
            if now - self.beaten < 2 * self.every:   # the loop beats
                said = False
            elif now - self.ran < self.hung:
                self.beaten = now
                self.beat()
                said = False
            elif not said:
                said = True
                log.error("the enforcer's loop has not run for %g s: its heartbeat stops, and BPF "
                          "admits every call, unchecked, 2 s later (stalled work must not wait on a "
                          "hung enforcer)", self.hung)

    def stop(self):
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
