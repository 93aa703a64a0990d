"""Log lines a container can cause, rate-limited (issue 24 row 7: hundreds of driver copies
opened at once must not flood the log): at most one per (container, reason) every
LOG_EVERY_S seconds, the next one saying how many were left out. The tracer's `say` is one
(probes/tracer.py); discovery and identity speak through it."""
import collections
import logging
import time

LOG_EVERY_S = 600.0   # one line per (container, reason) in this long; the rest are counted

log = logging.getLogger(__name__)


class Said:
    """Log lines a container can cause, at most one per (container, reason) every LOG_EVERY_S
    seconds (the next one says how many were left out); at most `keys` remembered."""

    def __init__(self, every: float = LOG_EVERY_S, keys: int = 4096):
        self.every, self.keys = every, keys
        self.last: collections.OrderedDict = collections.OrderedDict()   # key -> (when, left out)

    def __call__(self, level: int, key, msg: str, *args) -> bool:
        now = time.monotonic()
        when, skipped = self.last.pop(key, (None, 0))
        if when is not None and now - when < self.every:
            self.last[key] = (when, skipped + 1)
            return False
        self.last[key] = (now, 0)
        while len(self.last) > self.keys:
            self.last.popitem(last=False)
        log.log(level, msg + (f" ({skipped} more like it left out)" if skipped else ""), *args)
        return True


def container_of(pid: int) -> str:
    """A key for the rate limit: the process's cgroup, as the kernel names it."""
    try:
        with open(f"/proc/{pid}/cgroup", "rb") as f:
            return f.read(4096).strip().split(b"\n")[-1].decode(errors="replace")
    except OSError:
        return "?"
