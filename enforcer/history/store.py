"""Each job's recent runs, kept in one file of the state dir: <state dir>/history.jsonl, next to
decisions.json and written by the same rules (enforcer/tenants/statefile.py, STYLE.md 17):

- written whole: a temporary file, fsynced, renamed over the old one, the directory fsynced;
- one job a line after a header line (encode() says why), read with caps (a regular file,
  never through a symlink, at most MAX_BYTES) and checked: a format name, a version, the
  number of jobs, a checksum over the lines, every entry typed and within the caps. A
  file that fails is reported in one line and never written over: new runs wait in memory
  (the recorder keeps at most MAX_PENDING) until it is repaired or moved aside;
- several writers (the enforcer, a `convgpu trace` where none runs, two enforcers on one
  state dir) each add their runs to what the file holds when they write, under an flock of
  <state dir>/.history.lock: none overwrites another's runs;
- bounded: the newest MAX_RUNS runs of a job; at most MAX_JOBS jobs, and when a new job would
  be one too many, the least recently run job of the scope (jobs.py: a Kubernetes namespace,
  a user, else where the name came from) that holds the most jobs goes, so a tenant that invents
  names pushes out its own jobs first; only the newest SERIES_RUNS runs of a job keep their
  time series (POINTS points per GPU, in MiB: for the picture only; peaks are exact bytes);
  and an encoded file above MAX_BYTES drops the series of its oldest runs until it fits.

Pure parts (Run, History, encode, decode, add) need no file; HistoryFile is the only part that
touches one (tests/unit/test_history.py)."""
import fcntl
import hashlib
import json
import os
import time
from dataclasses import dataclass, field, replace

from ..tenants.statefile import Unreadable, checked_header, loads, read_file, write_whole
from .jobs import Job, parse_key

FILE = "history.jsonl"
LOCK = ".history.lock"
FORMAT = "convgpu-history"
VERSION = 1
MAX_RUNS = 10            # per job: the method's window (recommend.py) reads at most these
MAX_JOBS = 256           # a node's jobs over weeks; each one is a metric series too
SERIES_RUNS = 3          # the newest runs of a job that keep their time series
POINTS = 120             # per GPU and run (recorder.py halves a longer series, keeping maxima)
MAX_GPUS = 16            # per run (CG_MAX_DEV)
MAX_WAITS = 64           # wait intervals per run
MAX_TEXT = 256           # characters of a source, a container, a run id
MAX_BYTES = 8 << 20      # a larger file is not ours (every cap full, one GPU a run: 3 MiB; eight GPUs: this)
MiB = 1 << 20


@dataclass(frozen=True)
class GpuRun:
    """A run on one GPU. peak: what it held at most, its allocations and its context charge
    together (what its limit is counted against); used: its allocations at most; ctx: its
    context charge at most; limit: its limit there (None: none, e.g. under `convgpu trace`)."""
    peak: int
    used: int
    ctx: int
    contexts: int
    limit: int | None


@dataclass(frozen=True)
class Series:
    """A run's memory over time, for its picture: t (s since the run began) and per GPU, at
    each t, what it held, its context charge and its limit (MiB, rounded up; a point is the
    maximum over the interval it stands for); waits: (from s, to s, GPU) while it waited."""
    t: tuple = ()
    held: dict = field(default_factory=dict)    # gpu -> tuple of MiB
    ctx: dict = field(default_factory=dict)
    limit: dict = field(default_factory=dict)
    waits: tuple = ()


@dataclass(frozen=True)
class Run:
    id: str
    started: float           # wall clock
    ended: float
    container: str           # the container it ran in (a short id or a cgroup), for the reader
    limit: int | None        # what it asked (its limit; None: none known)
    source: str              # where that limit came from
    gpus: dict               # gpu -> GpuRun
    allocs: int = 0
    contexts: int = 0
    stalls: int = 0
    stalled_s: float = 0.0
    at_limit_s: float = 0.0  # seconds it was seen waiting with its whole limit assigned
    over_limits: int = 0     # calls above its limit
    end: str = "exit"        # exit | stopped (the recorder stopped while it ran)
    by: str = "enforce"      # enforce | trace
    series: Series | None = None

    @property
    def peak(self) -> int:
        """What it held at most on any one GPU (a limit applies on each GPU)."""
        return max((g.peak for g in self.gpus.values()), default=0)


@dataclass(frozen=True)
class History:
    jobs: dict = field(default_factory=dict)   # job key -> tuple of Run, oldest first

    def runs(self, key: str) -> tuple:
        return self.jobs.get(key, ())


def add(h: History, job: Job, runs) -> History:
    """h with `runs` of `job` added (a run already there, by id, is not added twice), bounded
    as the module says."""
    jobs = dict(h.jobs)
    old = jobs.get(job.key, ())
    ids = {r.id for r in old}
    new = sorted(old + tuple(r for r in runs if r.id not in ids), key=lambda r: (r.ended, r.id))[-MAX_RUNS:]
    keep = len(new) - SERIES_RUNS
    jobs[job.key] = tuple(r if i >= keep or r.series is None else replace(r, series=None) for i, r in enumerate(new))
    while len(jobs) > MAX_JOBS:
        del jobs[_evicted(jobs, job.key)]
    return History(jobs)


def _evicted(jobs: dict, keep: str) -> str:
    """The least recently run job of the scope that holds the most jobs (never `keep`); of
    scopes that hold as many, `keep`'s own first (a flood that reaches another's size pushes
    out its own, not the other's older job)."""
    scope = {k: parse_key(k).scope for k in jobs}
    size: dict = {}
    for s in scope.values():
        size[s] = size.get(s, 0) + 1
    return min((k for k in jobs if k != keep),
               key=lambda k: (-size[scope[k]], scope[k] != scope[keep], jobs[k][-1].ended if jobs[k] else 0.0, k))


# ---- the file's format ----

def _series_wire(s: Series) -> dict:
    return {"t": list(s.t), "held": {str(d): list(v) for d, v in s.held.items()},
            "ctx": {str(d): list(v) for d, v in s.ctx.items()},
            "limit": {str(d): list(v) for d, v in s.limit.items()}, "waits": [list(w) for w in s.waits]}


def _run_wire(r: Run) -> dict:
    d = {"id": r.id, "started": r.started, "ended": r.ended, "container": r.container, "limit": r.limit,
         "source": r.source,
         "gpus": {str(k): [g.peak, g.used, g.ctx, g.contexts, g.limit] for k, g in sorted(r.gpus.items())},
         "allocs": r.allocs, "contexts": r.contexts, "stalls": r.stalls, "stalled_s": r.stalled_s,
         "at_limit_s": r.at_limit_s, "over_limits": r.over_limits, "end": r.end, "by": r.by}
    if r.series is not None:
        d["series"] = _series_wire(r.series)
    return d


def _line(key: str, runs) -> bytes:
    return json.dumps([key, [_run_wire(r) for r in runs]], separators=(",", ":")).encode()


def _head(body: bytes, jobs: int, written: float, written_by: str) -> bytes:
    return json.dumps({"format": FORMAT, "version": VERSION, "written": written, "by": written_by[:MAX_TEXT],
                       "jobs": jobs, "sha256": hashlib.sha256(body).hexdigest()}, sort_keys=True).encode()


def encode(h: History, written_by: str = "") -> bytes:
    """The file's bytes: a header line (format, version, how many jobs, a checksum of the rest),
    then one line per job, [key, [run, ...]], in key order. One line at a time, so that no
    single json call holds the interpreter (and the enforcer's loop) for long: a whole history
    of 3 MiB took 65 ms in one json.dumps. Above MAX_BYTES the oldest runs' series are dropped
    until it fits."""
    jobs = dict(h.jobs)
    lines = {k: _line(k, jobs[k]) for k in sorted(jobs)}
    written = round(time.time(), 3)
    size = len(_head(b"", len(lines), written, written_by)) + sum(len(x) + 1 for x in lines.values())
    oldest = iter(sorted((r.ended, k, r.id) for k, runs in jobs.items() for r in runs if r.series is not None))
    while size > MAX_BYTES:
        _, key, rid = next(oldest)   # the caps keep a history without series far below MAX_BYTES
        runs = jobs[key] = tuple(replace(r, series=None) if r.id == rid else r for r in jobs[key])
        new = _line(key, runs)
        size -= len(lines[key]) - len(new)
        lines[key] = new
    body = b"".join(x + b"\n" for x in lines.values())
    return _head(body, len(lines), written, written_by) + b"\n" + body


def decode(raw: bytes) -> History:
    """The file's bytes as a History; Unreadable (one line: what is wrong) if they are not a
    whole, checked history file of this version within the caps."""
    head, _, body = raw.partition(b"\n")
    doc = loads(head)
    checked_header(doc, FORMAT, VERSION)
    n = doc.get("jobs")
    if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_JOBS:
        raise Unreadable(f"its header gives {str(n)[:20]} jobs (at most {MAX_JOBS})")
    lines = body.split(b"\n")
    if doc.get("sha256") != hashlib.sha256(body).hexdigest() or len(lines) != n + 1 or lines[-1]:
        raise Unreadable("its checksum does not match its history (changed or cut short)")
    out: dict = {}
    prev = ""
    try:
        for line in lines[:-1]:
            key, runs = loads(line)
            if parse_key(key).key <= prev:   # written in key order, each once
                raise ValueError(f"job {key[:80]!r} out of order")
            out[key] = _parse_job(key, runs)
            prev = key
    except (ValueError, TypeError, AttributeError, KeyError) as e:
        raise Unreadable(f"an entry is not valid ({e})") from None
    return History(out)


def _int(v, what: str, none: bool = False) -> int | None:
    if v is None and none:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ValueError(f"{what} {v!r}")
    return v


def _num(v, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0 or v == float("inf"):
        raise ValueError(f"{what} {v!r}")
    return float(v)


def _text(v, what: str, choices=()) -> str:
    if not isinstance(v, str) or len(v) > MAX_TEXT or (choices and v not in choices):
        raise ValueError(f"{what} {str(v)[:80]!r}")
    return v


def _gpu(k) -> int:
    if not isinstance(k, str) or not k.isdigit() or int(k) >= MAX_GPUS:
        raise ValueError(f"gpu {str(k)[:20]!r}")
    return int(k)


def _points(v, n: int, what: str) -> tuple:
    if not isinstance(v, list) or len(v) != n:
        raise ValueError(f"{what}: {n} points expected")
    return tuple(_int(x, what) for x in v)


def _parse_series(s: dict) -> Series:
    t = s["t"]
    if not isinstance(t, list) or len(t) > POINTS * 2:
        raise ValueError("series t")
    t = tuple(_num(x, "series t") for x in t)
    per = {}
    for name in ("held", "ctx", "limit"):
        if not isinstance(s[name], dict) or len(s[name]) > MAX_GPUS:
            raise ValueError(f"series {name}")
        per[name] = {_gpu(d): _points(v, len(t), f"series {name}") for d, v in s[name].items()}
    waits = s["waits"]
    if not isinstance(waits, list) or len(waits) > MAX_WAITS:
        raise ValueError("series waits")
    return Series(t, per["held"], per["ctx"], per["limit"],
                  tuple((_num(a, "wait"), _num(b, "wait"), _gpu(str(d))) for a, b, d in waits))


def _parse_run(r: dict) -> Run:
    gpus = r["gpus"]
    if not isinstance(gpus, dict) or len(gpus) > MAX_GPUS:
        raise ValueError("gpus")
    per = {}
    for k, g in gpus.items():
        if not isinstance(g, list) or len(g) != 5:
            raise ValueError(f"gpu {k!r}")
        per[_gpu(k)] = GpuRun(_int(g[0], "peak"), _int(g[1], "used"), _int(g[2], "ctx"), _int(g[3], "contexts"),
                              _int(g[4], "limit", none=True))
    return Run(_text(r["id"], "id"), _num(r["started"], "started"), _num(r["ended"], "ended"),
               _text(r["container"], "container"), _int(r["limit"], "limit", none=True), _text(r["source"], "source"),
               per, _int(r["allocs"], "allocs"), _int(r["contexts"], "contexts"), _int(r["stalls"], "stalls"),
               _num(r["stalled_s"], "stalled_s"), _num(r["at_limit_s"], "at_limit_s"),
               _int(r["over_limits"], "over_limits"), _text(r["end"], "end", ("exit", "stopped")),
               _text(r["by"], "by", ("enforce", "trace")),
               _parse_series(r["series"]) if "series" in r else None)


def _parse_job(key, runs) -> tuple:
    parse_key(key)
    if not isinstance(runs, list) or len(runs) > MAX_RUNS:
        raise ValueError(f"runs of {key[:80]!r}: at most {MAX_RUNS}")
    return tuple(_parse_run(r) for r in runs)


class HistoryFile:
    """<state_dir>/history.jsonl. read(): the History (none yet: empty), Unreadable or OSError
    where it cannot be read. append(): runs added under the lock, the file written whole."""

    def __init__(self, state_dir: str, written_by: str = ""):
        self.dir = state_dir
        self.path = os.path.join(state_dir, FILE)
        self.written_by = written_by or f"convgpu pid {os.getpid()}"
        self.writes = 0

    def read(self) -> History:
        try:
            return decode(read_file(self.path, MAX_BYTES, "a history file"))
        except FileNotFoundError:
            return History()

    def append(self, runs: list[tuple[Job, Run]]) -> History:
        """Adds runs to what the file holds now, and writes it. Unreadable (the file is kept
        as it is) or OSError: nothing was written."""
        os.makedirs(self.dir, mode=0o755, exist_ok=True)
        fd = os.open(os.path.join(self.dir, LOCK), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)   # held for one read and one write: milliseconds
            h = self.read()
            for job, run in runs:
                h = add(h, job, (run,))
            write_whole(self.path, encode(h, self.written_by), ".history-")
            self.writes += 1
            return h
        finally:
            os.close(fd)


def check(state_dir: str) -> tuple[str, str]:
    """For `convgpu doctor`: (state, detail). state: ok | none | unreadable."""
    f = HistoryFile(state_dir)
    try:
        raw = read_file(f.path, MAX_BYTES, "a history file")
    except FileNotFoundError:
        return "none", f"{f.path}: none yet"
    except (OSError, Unreadable) as e:
        return "unreadable", f"{f.path}: {e.strerror if isinstance(e, OSError) and e.strerror else e}"
    try:
        h = decode(raw)
    except Unreadable as e:
        return "unreadable", f"{f.path}: {e}"
    return "ok", f"{f.path}: {len(h.jobs)} jobs, {sum(len(r) for r in h.jobs.values())} runs"
