"""The threads BPF stopped at an open of a driver file or a GPU node, from the tracer's side
(bpf/discovery.bpf.c stop_at_open): listed, resumed, and let go when the loop hangs.

Nothing stays stopped for good: BPF lists every thread it stops in `held` before the stop,
and the watchdog (enforcer/failsafe/watchdog.py) that runs beside every tracer with discovery on
resumes them all and turns discovery off if the tracer dies. A stop whose event never came (the
ring buffer was full) is found in `held` by the loop (Discovery.lost, through `unchanged`) and
looked at as if it had come; each stop's `held` value carries a stamp, so a resume never
deletes the entry of the stop that follows it (the same thread opening a driver file again at
once, at the same fd). Discovery follows the loop: each pass stamps `beat_ns` in the discovery
map, and BPF stops nobody once it is DISCOVERY_STALE_NS old; `watch` resumes those already held
if the loop has not run for STALE_S (a hung loop must not hold every new CUDA process: issue 24
row 3). Admission's stalls are in `held` too, without HELD_OPEN: they are the enforcer's."""
import ctypes as ct
import logging
import os
import signal
import time

HELD_OPEN = 1 << 32   # bpf/maps.bpf.c: a `held` value for a stop at a driver's open (else a stall)
HELD_NODE = 1 << 33   # ... at its open of a GPU node (probes/identity.py)
LOST_AFTER_S = 1.0    # a stop listed in `held` this long with no event told (ring buffer full) is looked at
STALE_S = 3.0         # bpf/discovery.bpf.c DISCOVERY_STALE_NS: BPF stops nobody after this

log = logging.getLogger(__name__)


class Held:
    def __init__(self, table):
        self.table = table                      # () -> bcc's `held` map
        self.seen: dict[int, int] = {}          # the stops at an open the last look found
        self.looked = time.monotonic()

    def listed(self) -> list[int]:
        """Threads (pid_tgid) stopped at an open: ours to resume (stalls are the enforcer's)."""
        return [k.value for k, v in self.table().items() if v.value & HELD_OPEN]

    def still(self, key: int, fd: int) -> bool:
        """key is still stopped at the open of fd that BPF told us about (`watch` lets go of
        those a stale loop held: their event, read later, names an fd they may have reused)."""
        try:
            v = self.table()[ct.c_uint64(key)].value
        except KeyError:
            return False
        return bool(v & HELD_OPEN) and (v & 0xFFFFFFFF) == fd

    def resume(self, key: int):
        """SIGCONT before the entry goes: dying in between leaves the watchdog one to resume.
        The entry goes only if it is still the stop we resumed: the thread, running again, may
        already be stopped at its next open (a driver's dlopen, then its cuInit's GPU node),
        whose entry must stay (deleted, that thread stayed stopped with nobody to resume it)."""
        k, held = ct.c_uint64(key), self.table()
        try:
            was = held[k].value
        except KeyError:
            was = None
        try:
            os.kill(key >> 32, signal.SIGCONT)
        except ProcessLookupError:
            pass
        try:
            if was is None or held[k].value == was:
                del held[k]
        except KeyError:
            pass

    def unchanged(self) -> list[tuple[int, int]] | None:
        """The stops at an open (key, value) listed unchanged since the last look, LOST_AFTER_S
        or more ago (each stop's value is stamped: unchanged, it is the same stop); None: too
        early to look again."""
        now = time.monotonic()
        if now - self.looked < LOST_AFTER_S:
            return None
        self.looked = now
        held = {k.value: v.value for k, v in self.table().items() if v.value & HELD_OPEN}
        same = [(k, v) for k, v in held.items() if self.seen.get(k) == v]
        self.seen = held
        return same

    def watch(self, beaten, stop) -> None:
        """A thread: if the loop has not run for STALE_S (beaten(): when it last did), BPF
        already stops nobody new; this lets go of those it holds (fail open, as admission does
        when the heartbeat lapses). Until stop (a threading.Event) is set."""
        said = False
        while not stop.wait(1.0):
            if time.monotonic() - beaten() < STALE_S:
                said = False
                continue
            held = self.listed()
            if held and not said:
                log.error("the loop has not run for %.0f s: %d process(es) held at a driver's open "
                          "are let go unprobed, and discovery stops nobody until it runs again",
                          time.monotonic() - beaten(), len({k >> 32 for k in held}))
                said = True
            for key in held:
                self.resume(key)
