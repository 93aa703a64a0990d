"""The recorder: each container's run, from what it is shown once a second (seen.py) to its
end, then one Run in the history file (store.py). It owns its state; the enforcer hands it a
Seen per container each second (from its books), says when a process exits and when a
container's run ends, and nothing more. Nothing is added to the hot path: the figures are the
books' and the probes' own (BPF keeps each process's peak at every allocation).

Peak on a GPU (what the recommendation reads): what the container held, never what it asked
(issue 52: a request that stalled a self-test child read as a peak of 676473.8 TiB, and a sum of
its processes' peaks showed a job at 576 MiB that held at most 448): the largest of what the
books held at a sample (allocations and context charge, NVML's measurement where it has one),
where one process alone is the container's on that GPU, its own peak (BPF's, exact, kept at
every allocation) plus its context charge, and what a process held when it exited (exited():
one that begins and ends between two samples is seen only so). A request it was stopped at
is not a peak: it never held it; a job held at its limit is flagged, and its recommendation is
a floor (recommend.py).

Files are written by a thread of its own (a write is a read and a write of up to a few MiB,
fsynced), at most every WRITE_GAP, never in the enforcer's loop."""
import logging
import os
import threading
import time

from ...threads import Thread
from .store import MAX_GPUS, MAX_TEXT, MAX_WAITS, POINTS, GpuRun, History, Run, Series, Unreadable, add

log = logging.getLogger(__name__)
MiB = 1 << 20
MAX_LIVE = 4096        # containers followed at once (the enforcer's own caps are far below)
MAX_PENDING = 256      # runs kept in memory while the file cannot be written; then the oldest go
WRITE_GAP = 2.0        # s between two writes: runs that end meanwhile go in one write
RETRY = 60.0           # s before a file that failed is tried again, unless another run ends
MAX_DT = 5.0           # s one sample may stand for (a loop held longer adds no more waiting)


def _mib(n: int | None) -> int:
    return 0 if not n else -(-n // MiB)


class _Live:
    """One container's run so far."""

    def __init__(self, seen, now: float):
        self.job, self.container, self.last = seen.job, seen.container[:MAX_TEXT], None
        self.started = now if seen.since is None else min(now, seen.since)
        self.limit, self.source = seen.limit, seen.source[:MAX_TEXT]
        self.gpus: dict = {}       # dev -> [peak, used, ctx, contexts, limit]
        self.procs: dict = {}      # (pid, gen, dev) -> [peak, ctx, contexts, allocs]
        self.done = [0, 0]         # allocations and contexts of processes gone
        self.t: list = []
        self.points: dict = {}     # dev -> ([held], [ctx], [limit]) in MiB, aligned with t
        self.waits: list = []      # [from, to, dev, since]
        self.at_limit_s = 0.0
        self.stalls, self.stalled_s, self.over_limits = 0, 0.0, 0

    def update(self, seen, now: float):
        dt = min(now - self.last, MAX_DT) if self.last is not None else 0.0
        self.last = now
        self.limit, self.source = seen.limit, seen.source[:MAX_TEXT]
        self.stalls, self.stalled_s, self.over_limits = seen.stalls, seen.stalled_s, seen.over_limits
        now_procs = {(p.pid, p.gen, p.dev): p for p in seen.procs if 0 <= p.dev < MAX_GPUS}
        for k in [k for k in self.procs if k not in now_procs]:
            self._fold(k)
        for k, p in now_procs.items():
            r = self.procs.setdefault(k, [0, 0, 0, 0])
            r[0], r[1], r[2], r[3] = max(r[0], p.peak), max(r[1], p.ctx), max(r[2], p.contexts), p.allocs
        tops = {}   # dev -> what it held at most since the last sample: the series' point
        for dev, g in seen.gpus.items():
            if not 0 <= dev < MAX_GPUS:
                continue
            s = self.gpus.setdefault(dev, [0, 0, 0, 0, None])
            alone = [now_procs[k] for k in now_procs if k[2] == dev]
            tops[dev] = max(g.held, alone[0].peak + alone[0].ctx if len(alone) == 1 else 0)
            s[0] = max(s[0], tops[dev])
            s[1] = max(s[1], g.used, alone[0].peak if len(alone) == 1 else 0)
            s[2], s[3], s[4] = max(s[2], g.ctx), max(s[3], g.contexts), g.limit
            if g.wait_since is not None:
                self._waited(dev, g.wait_since, now)
                if g.limit is not None and g.assigned is not None and g.assigned >= g.limit:
                    self.at_limit_s += dt   # it waits with its whole limit assigned: on itself
        self._point(now, seen.gpus, tops)

    def _fold(self, k):
        r = self.procs.pop(k)
        self.done[0] += r[3]
        self.done[1] += r[2]

    def exited(self, pid: int, held: dict):
        """pid exited holding held[dev] (allocations and contexts, as the exit counted them):
        a floor for the peak (its last sample may be a second old)."""
        for dev, n in held.items():
            if dev in self.gpus:
                self.gpus[dev][0] = max(self.gpus[dev][0], n)
                if self.points.get(dev) and self.points[dev][0]:   # the plot's line shows it too
                    self.points[dev][0][-1] = max(self.points[dev][0][-1], _mib(n))
        for k in [k for k in self.procs if k[0] == pid]:
            self._fold(k)

    def _waited(self, dev: int, since: float, now: float):
        for w in self.waits:
            if w[2] == dev and w[3] == since:
                w[1] = now - self.started
                return
        if len(self.waits) >= MAX_WAITS:   # the last interval stretches over the rest
            self.waits[-1][1] = now - self.started
            return
        self.waits.append([max(0.0, since - self.started), now - self.started, dev, since])

    def _point(self, now: float, gpus: dict, tops: dict):
        n = len(self.t)
        self.t.append(round(now - self.started, 3))
        for dev in gpus:
            if 0 <= dev < MAX_GPUS and dev not in self.points:
                self.points[dev] = ([0] * n, [0] * n, [0] * n)
        for dev, (held, ctx, limit) in self.points.items():
            g = gpus.get(dev)
            held.append(_mib(tops.get(dev, g.held)) if g else 0)
            ctx.append(_mib(g.ctx) if g else 0)
            limit.append(_mib(g.limit) if g else 0)
        if len(self.t) >= 2 * POINTS:
            self._halve()

    def _halve(self):
        """Every two points become one: the first's time, the larger of each value."""
        self.t = self.t[::2]
        for dev, arrays in self.points.items():
            self.points[dev] = tuple([max(a[i:i + 2]) for i in range(0, len(a), 2)] for a in arrays)

    def finish(self, now: float, end: str, by: str, rid: str) -> Run:
        for k in list(self.procs):
            self._fold(k)
        while len(self.t) > POINTS:
            self._halve()
        per = [{d: tuple(a[i]) for d, a in self.points.items()} for i in range(3)]   # held, ctx, limit
        series = Series(tuple(self.t), *per, tuple((round(a, 3), round(b, 3), d) for a, b, d, _ in self.waits))
        return Run(rid, round(self.started, 3), round(now, 3), self.container, self.limit, self.source,
                   {d: GpuRun(*g) for d, g in sorted(self.gpus.items())}, self.done[0], self.done[1], self.stalls,
                   round(self.stalled_s, 3), round(self.at_limit_s, 3), self.over_limits, end, by, series)


class Recorder:
    """Runs of containers, written to `file` (store.HistoryFile; None: kept in memory only).
    by: who records ("enforce" or "trace"); absent_ends: a container missing from a sample has
    ended (trace: it sees containers only through their processes' rows)."""

    def __init__(self, file=None, by: str = "enforce", clock=time.time, absent_ends: bool = False):
        self.file, self.by, self.clock, self.absent_ends = file, by, clock, absent_ends
        self.live: dict = {}
        self.pending: list = []      # (Job, Run) not written yet
        self.dropped = 0
        self.error = ""              # why the file cannot be read or written now ("" : it can)
        self.latest = History()      # what the file held at the last read or write
        self.summary: tuple = ()     # the recommendations of latest (recommend.summarize), for metrics
        self._cv = threading.Condition()
        self._thread = None
        self._closing = False
        self._n = 0

    # ---- the loop's calls ----
    def sample(self, seen, now: float | None = None):
        now = self.clock() if now is None else now
        if self._thread is None and self.file is not None:
            self._thread = Thread(target=self._loop, name="convgpu-history", daemon=True)
            self._thread.start()
        keys = set()
        for s in seen:
            keys.add(s.key)
            live = self.live.get(s.key)
            if live is None:
                if len(self.live) >= MAX_LIVE:
                    continue
                live = self.live[s.key] = _Live(s, now)
            live.update(s, now)
        if self.absent_ends:
            for k in [k for k in self.live if k not in keys]:
                self.ended(k, now)

    def exited(self, key: str, pid: int, held: dict):
        live = self.live.get(key)
        if live is not None:
            live.exited(pid, held)

    def ended(self, key: str, now: float | None = None, end: str = "exit"):
        live = self.live.pop(key, None)
        if live is None or live.last is None:
            return
        self._n += 1
        rid = f"{os.getpid():x}-{int(live.started * 1000):x}-{self._n:x}"   # unique across recorders and restarts
        run = live.finish(self.clock() if now is None else now, end, self.by, rid)
        with self._cv:
            self.pending.append((live.job, run))
            if len(self.pending) > MAX_PENDING:
                del self.pending[0]
                self.dropped += 1
            self._cv.notify()

    def close(self, now: float | None = None):
        """Every run still going ends ("stopped"); what is pending is written now."""
        for k in list(self.live):
            self.ended(k, now, end="stopped")
        with self._cv:
            self._closing = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        self.flush()

    def status(self) -> dict:
        """For `convgpu status --json`: where the history goes and whether it can."""
        state = "memory" if self.file is None else "unreadable" if self.error else "ok"
        return {"path": self.file.path if self.file else "", "state": state, "error": self.error,
                "live": len(self.live), "pending": len(self.pending), "dropped": self.dropped,
                "jobs": len(self.latest.jobs), "writes": self.file.writes if self.file else 0}

    # ---- the file ----
    def flush(self) -> bool:
        """Write what is pending (in the caller's thread). False: it could not be (error says why)."""
        from .recommend import summarize
        with self._cv:
            batch = list(self.pending)
        if not batch:
            return True
        if self.file is None:
            h = self.latest
            for job, run in batch:
                h = add(h, job, (run,))
        else:
            try:
                h = self.file.append(batch)
            except (Unreadable, OSError) as e:
                self._failed(e)
                return False
            if self.error:
                log.info("job history written again to %s", self.file.path)
            self.error = ""
        with self._cv:
            self.pending = [p for p in self.pending if not any(p is b for b in batch)]
        self.latest, self.summary = h, summarize(h)
        return True

    def _failed(self, e: Exception):
        why = f"{self.file.path}: {e.strerror if isinstance(e, OSError) and e.strerror else e}"
        with self._cv:   # the writer's thread and a caller's flush() may fail at once: said once, and
            if why != self.error:   # said before the other can see `error` set
                log.error("job history cannot be %s (%s); it is kept as it is, and new runs wait in memory (at "
                          "most %d) until it is %s", "read" if isinstance(e, Unreadable) else "written", why,
                          MAX_PENDING, "repaired or moved aside" if isinstance(e, Unreadable) else "writable")
            self.error = why

    def _loop(self):
        from .recommend import summarize
        try:
            self.latest = self.file.read()
            self.summary = summarize(self.latest)
        except (Unreadable, OSError) as e:
            self._failed(e)
        while True:
            with self._cv:
                while not self.pending and not self._closing:
                    self._cv.wait()
                if self._closing:
                    return
            wrote, had, t0 = self.flush(), len(self.pending), time.monotonic()
            with self._cv:   # runs that end meanwhile go in the next write; after a failure, a new run tries again
                while not self._closing:
                    waited = time.monotonic() - t0
                    if waited >= (WRITE_GAP if wrote else RETRY) or (waited >= WRITE_GAP and len(self.pending) != had):
                        break
                    self._cv.wait((WRITE_GAP if wrote or waited < WRITE_GAP else RETRY) - waited)
