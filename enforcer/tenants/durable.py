"""Run-time decisions that must survive a restart (issue 31): `convgpu run`'s registrations
(limit and name, by cgroup), `convgpu limit set` (by container id), the Kubernetes agent's
`pod-limits` and the DRA plugin's prepared claims (tenants/claims.py). One value (Decisions) held by the enforcer, kept whole in one file of the state
dir, <state dir>/decisions.json, as the kubelet keeps its checkpoints (STYLE.md 17):

- a decision is written before it is acknowledged, and applied only once written: the new
  value goes to a temporary file, which is fsynced and renamed over the old one, and the
  directory is fsynced (the rename itself is then on disk). A write that fails (a full or
  read-only state dir) is refused to the client with one line and nothing changes: what is
  enforced is what a restart would read back;
- the file is read before the first admission; it carries a format name, a version (an older
  version is migrated when read: MIGRATIONS) and a checksum over its decisions. A file that
  cannot be read (corrupt, a newer format, unreadable) is one error line, kept as it is for the
  operator and never written over; the enforcer then fails closed (enforcer/runtime.py
  Runtime.decided says what that means and why);
- a container is what the kernel says it is: its cgroup path with the cgroup's id (the
  inode of its cgroupfs directory, which the kernel never reuses within a boot). An entry goes
  once that cgroup is gone, or its path holds another cgroup (a container restarted under the
  same name is a new container); a `convgpu run` cgroup made before its first CUDA call keeps
  its entry, since the cgroup itself is there. The Kubernetes agent's set is its own to change:
  it sends the whole set again at each change, and a pod that went leaves it then;
- bounded: MAX_ENTRIES of each kind, names and sources cut to MAX_TEXT, a file read up to
  MAX_BYTES.

Two enforcers must not write one state dir (each would write its own value over the other's):
the directory is locked (flock) for the enforcer's life, and a second enforcer on it (another
run dir) reads it but refuses every decision. Pure parts (Decisions, encode, decode) need no
file; Store is the only part that touches one (tests/unit/test_durable.py)."""
import fcntl
import json
import logging
import os
import stat
import time
from dataclasses import dataclass, field, replace

from ...errors import ConvgpuError
from ...faults import FAULT
from .containers import cgroup_layout
from .statefile import Unreadable, checked_body, digest, read_file, write_whole  # noqa: F401  (Unreadable: ours too)

log = logging.getLogger(__name__)
FILE = "decisions.json"
FORMAT = "convgpu-decisions"
VERSION = 2             # 2: "claims" (issue 40)
MAX_ENTRIES = 4096       # of each kind: a node's containers with a decision, many times over
MAX_TEXT = 1024          # characters of a name, an id or a source
MAX_PATH = 4096          # characters of a cgroup path (PATH_MAX)
MAX_BYTES = 16 << 20     # a larger file is not ours (MAX_ENTRIES of each kind take ~3 MiB)
LOCK_WAIT = 1.0          # s a start waits for the state dir's lock (a predecessor still exiting)
# MIGRATIONS[v]: a version-v document's "decisions" as version v + 1 has them. Empty while
# version 1 is the only one; a change of the format adds its step here (and a test of it).
MIGRATIONS: dict = {1: lambda body: {**body, "claims": {}}}


class NotKept(ConvgpuError):
    """A decision that could not be written: it is not applied, and the client is told."""


@dataclass(frozen=True)
class Run:
    """`convgpu run`: its cgroup's limit and name."""
    limit: int
    name: str | None
    cgroup_id: int | None


@dataclass(frozen=True)
class LimitSet:
    """`convgpu limit set`: a container's limit (by container id), and the cgroup it had."""
    limit: int
    cgroup: str
    cgroup_id: int | None


@dataclass(frozen=True)
class Decisions:
    runs: dict = field(default_factory=dict)     # cgroup path -> Run
    limits: dict = field(default_factory=dict)   # container id -> LimitSet
    pods: dict = field(default_factory=dict)     # container id or pod uid -> PodLimit
    claims: dict = field(default_factory=dict)   # DRA claim uid -> ClaimShare

    def with_run(self, cgroup: str, run: Run) -> "Decisions":
        _room(self.runs, cgroup, "`convgpu run` registrations")
        return replace(self, runs={**self.runs, cgroup: run})

    def with_limit(self, cid: str, entry: LimitSet) -> "Decisions":
        _room(self.limits, cid, "`convgpu limit set` limits")
        return replace(self, limits={**self.limits, cid: entry})

    def with_pods(self, pods: dict) -> "Decisions":
        if len(pods) > MAX_ENTRIES:
            raise NotKept(f"{len(pods)} pod limits are more than the state dir keeps ({MAX_ENTRIES})",
                          "this many containers on one node is not a Kubernetes node's; check the agent")
        return replace(self, pods=dict(pods))

    def with_claims(self, claims: dict) -> "Decisions":
        if len(claims) > MAX_ENTRIES:
            raise NotKept(f"{len(claims)} DRA claims are more than the state dir keeps ({MAX_ENTRIES})",
                          "unprepare claims of pods that are gone (the kubelet does)")
        return replace(self, claims=dict(claims))

    def without(self, runs=(), limits=()) -> "Decisions":
        return replace(self, runs={k: v for k, v in self.runs.items() if k not in runs},
                       limits={k: v for k, v in self.limits.items() if k not in limits})

    def counts(self) -> dict:
        return {"runs": len(self.runs), "limits": len(self.limits), "pods": len(self.pods),
                "claims": len(self.claims)}


def _room(d: dict, key: str, what: str):
    if key not in d and len(d) >= MAX_ENTRIES:
        raise NotKept(f"the state dir keeps {MAX_ENTRIES} {what} already (its cap)",
                      "containers that are gone leave it within seconds; see `convgpu status`")


def _text(s, what: str) -> str:
    if not isinstance(s, str) or len(s) > MAX_TEXT:
        raise ValueError(f"{what} {str(s)[:80]!r}")
    return s


def _size(v, what: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ValueError(f"{what} {v!r}")
    return v


def _ident(v, what: str) -> int | None:
    return None if v is None else _size(v, what)


def _body(d: Decisions) -> dict:
    return {"runs": {k: {"limit": r.limit, "name": r.name, "cgroup_id": r.cgroup_id} for k, r in sorted(d.runs.items())},
            "limits": {k: {"limit": e.limit, "cgroup": e.cgroup, "cgroup_id": e.cgroup_id}
                       for k, e in sorted(d.limits.items())},
            "pods": {k: p.wire() for k, p in sorted(d.pods.items())},
            "claims": {k: c.wire() for k, c in sorted(d.claims.items())}}


def encode(d: Decisions, written_by: str = "") -> bytes:
    body = _body(d)
    doc = {"format": FORMAT, "version": VERSION, "written": round(time.time(), 3), "by": written_by,
           "sha256": digest(body), "decisions": body}
    return (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode()


def decode(raw: bytes) -> Decisions:
    """The file's bytes as Decisions; Unreadable (one line: what is wrong) if they are not a
    whole, checked convgpu decisions file of this version or an older one."""
    version, body = checked_body(raw, FORMAT, VERSION, "decisions")
    for v in range(version, VERSION):   # an older format, brought up to this one step by step
        body = MIGRATIONS[v](body)
    try:
        return _parse(body)
    except (ValueError, TypeError, AttributeError, KeyError) as e:
        raise Unreadable(f"an entry is not valid ({e})") from None


def _parse(body: dict) -> Decisions:
    runs, limits, pods, claims = body["runs"], body["limits"], body["pods"], body["claims"]
    if not all(isinstance(x, dict) and len(x) <= MAX_ENTRIES for x in (runs, limits, pods, claims)):
        raise ValueError("runs, limits, pods and claims must be tables of at most %d entries" % MAX_ENTRIES)
    out = Decisions()
    for k, r in runs.items():
        name = r["name"]
        out.runs[_path(k)] = Run(_size(r["limit"], "limit"), None if name is None else _text(name, "name"),
                                 _ident(r["cgroup_id"], "cgroup_id"))
    for k, e in limits.items():
        out.limits[_text(k, "container id")] = LimitSet(_size(e["limit"], "limit"), _path(e["cgroup"]),
                                                        _ident(e["cgroup_id"], "cgroup_id"))
    from ..serving.podlimits import parse   # the wire formats' own checks
    from .claims import parse_all
    try:
        parsed = parse(pods)
        out.claims.update(parse_all(claims))
    except ConvgpuError as e:
        raise ValueError(e.problem) from None
    out.pods.update({_text(k, "pod key"): p._replace(source=_text(p.source, "source")) for k, p in parsed.items()})
    return out


def _path(p) -> str:
    if not isinstance(p, str) or len(p) > MAX_PATH or not p.startswith("/"):
        raise ValueError(f"cgroup {p[:80]!r}")
    return p


def cgroup_identity():
    """path -> the cgroup's id (its cgroupfs directory's inode; None where no such cgroup is):
    under the cgroup2 hierarchy, else the v1 freezer's (a hybrid host's engine that makes its
    containers in v1 only)."""
    lay = cgroup_layout()
    roots = [r for r in (lay.v2_root, lay.freezer_v1_root) if r]

    def identity(path: str) -> int | None:
        for root in roots:
            try:
                st = os.stat(root.rstrip("/") + ("" if path == "/" else path), follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode):
                return st.st_ino
        return None
    return identity


class Store:
    """The decisions and their file. value: what is in force; error: why the file could not be
    read at start ("" when it could; the file is then never written); write_error: the last
    write that failed ("" once one succeeds). state_dir None: kept in memory only (a restart
    forgets them; said at start)."""

    def __init__(self, state_dir: str | None, identity=None, written_by: str = ""):
        self.dir = state_dir or None
        self.path = os.path.join(self.dir, FILE) if self.dir else None
        self.identity = identity or cgroup_identity()
        self.written_by = written_by or f"convgpu enforce pid {os.getpid()}"
        self.value = Decisions()
        self.error = ""
        self.write_error = ""
        self.shared = ""         # why it is read only: another enforcer holds the directory's lock
        self._lock_fd = None
        self.writes = 0
        self.write_s = 0.0       # time spent writing (temp file, fsync, rename, fsync of the dir)

    # ---- start: lock, read ----
    def open(self, wait: float = LOCK_WAIT) -> "Store":
        """Lock the state dir, then read. Locked by another enforcer (another run dir on the same
        state dir: a test's, a benchmark's): read only, every decision refused (`shared`)."""
        if self.dir is None:
            log.warning("no --state-dir: run-time limits and names are kept in memory only, and a "
                        "restart forgets them")
            return self
        try:
            os.makedirs(self.dir, mode=0o755, exist_ok=True)
        except OSError as e:   # read-only and missing: nothing to read, every write refused
            log.error("state dir %s cannot be made (%s): run-time limits and names will be refused "
                      "until it can", self.dir, e.strerror)
            self.write_error = f"cannot make {self.dir}: {e.strerror}"
            return self
        if self._lock(wait):
            self._clean_temp()
        else:
            self.shared = f"another enforcer keeps its decisions in {self.dir} (it holds the directory's lock)"
            log.warning("%s: its decisions are read, and run-time limits and names given to this one are "
                        "refused; give it a --state-dir of its own", self.shared)
        self.load()
        return self

    def _lock(self, wait: float) -> bool:
        fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    return False
                time.sleep(0.05)
        self._lock_fd = fd
        return True

    def _clean_temp(self):
        """Temporary files of a write cut short (a kill -9 between write and rename)."""
        try:
            names = [n for n in os.listdir(self.dir) if n.startswith(".decisions-")]
        except OSError:
            return
        for n in names:
            try:
                os.unlink(os.path.join(self.dir, n))
            except OSError:
                pass

    def load(self) -> bool:
        """Read the file (none: no decisions yet). True if it could be read; otherwise
        `error` says why, in one line, and the value stays empty. Entries whose container is
        gone are dropped (and the file rewritten without them)."""
        if self.path is None:
            return True
        try:
            raw = read_file(self.path, MAX_BYTES)
        except FileNotFoundError:
            self.value, self.error = Decisions(), ""
            return True
        except (OSError, Unreadable) as e:
            self.error = f"{self.path}: {e.strerror if isinstance(e, OSError) and e.strerror else e}"
            return False
        try:
            self.value = decode(raw)
        except Unreadable as e:
            self.error = f"{self.path}: {e}"
            return False
        self.error = ""
        self.sweep()
        return True

    # ---- at run time ----
    def commit(self, new: Decisions, what: str):
        """Make `new` the value: written and on disk first. NotKept (nothing changed) where it
        cannot be."""
        if self.error:
            raise NotKept(f"{what} is not kept: the decisions file {self.error.split(': ', 1)[0]} could "
                          f"not be read at start ({self.error.split(': ', 1)[-1]}), and it is kept for "
                          "you as it is", "repair it or move it aside, then `convgpu reload`")
        if self.shared:
            raise NotKept(f"{what} is not kept: {self.shared}", "give this enforcer a --state-dir of its own")
        data = encode(new, self.written_by)
        try:
            decode(data)   # what is kept must read back, or the next start would hold everyone
        except Unreadable as e:
            raise NotKept(f"{what} is not kept: {e}", "give shorter names and sources") from None
        if self.path is not None:
            try:
                self._write(data)
            except OSError as e:
                self.write_error = f"{e.strerror or e}"
                raise NotKept(f"{what} is not kept: cannot write {self.path} ({e.strerror or e}); nothing "
                              "changed", "free space in (or make writable) the state dir, then try again") from None
            self.write_error = ""
        self.value = new

    def _write(self, data: bytes):
        t0 = time.monotonic()
        write_whole(self.path, data, ".decisions-",
                    lambda: FAULT.hit("save") if FAULT else None)   # written, not in place: the old value stays
        self.writes += 1
        self.write_s += time.monotonic() - t0

    def gone(self, cgroup: str, cgroup_id: int | None) -> bool:
        """The container an entry names is gone: no cgroup at its path, or another one."""
        now = self.identity(cgroup)
        return now is None or (cgroup_id is not None and now != cgroup_id)

    def sweep(self, container: tuple[str, str] | None = None) -> list[str]:
        """Drop the entries whose container is gone (container: (id, cgroup), only that one's,
        as it is placed); written where the file can be (best effort: a later write or the
        next start drops them too, and a gone container's entry can never apply to a new one,
        its identity differs). Returns what went, as log words."""
        v = self.value
        if container is None:
            runs = [k for k, r in v.runs.items() if self.gone(k, r.cgroup_id)]
            limits = [k for k, e in v.limits.items() if self.gone(e.cgroup, e.cgroup_id)]
        else:
            cid, cg = container
            runs = [cg] if cg in v.runs and self.gone(cg, v.runs[cg].cgroup_id) else []
            e = v.limits.get(cid)
            limits = [cid] if e is not None and self.gone(e.cgroup, e.cgroup_id) else []
        if not runs and not limits:
            return []
        new = v.without(runs, limits)
        if self.path is not None and not self.error and not self.shared:
            try:
                self._write(encode(new, self.written_by))
            except OSError as e:
                if not self.write_error:
                    log.warning("cannot write %s (%s): entries of containers that are gone stay in it "
                                "until a later write", self.path, e.strerror or e)
                self.write_error = f"{e.strerror or e}"
            else:
                self.write_error = ""
        self.value = new
        return [f"convgpu run {k}" for k in runs] + [f"limit set {k[:12]}" for k in limits]

    def status(self) -> dict:
        state = ("memory" if self.path is None else "unreadable" if self.error else
                 "another enforcer's" if self.shared else "ok")
        return {"path": self.path or "", "state": state, "error": self.error, "write_error": self.write_error,
                **self.value.counts(), "writes": self.writes,
                "write_ms": round(1000 * self.write_s / self.writes, 3) if self.writes else 0.0}

    def close(self):
        if self._lock_fd is not None:
            os.close(self._lock_fd)   # the lock goes with it
            self._lock_fd = None


def check(state_dir: str) -> tuple[str, str]:
    """For `convgpu doctor`: (state, detail) of the decisions file, read only (no lock: the file
    is only ever replaced whole). state: ok | none | unreadable | unwritable."""
    path = os.path.join(state_dir, FILE)
    try:
        d, state = decode(read_file(path, MAX_BYTES)), "ok"
    except FileNotFoundError:
        d, state = Decisions(), "none"
    except (OSError, Unreadable) as e:
        return "unreadable", f"{path}: {e.strerror if isinstance(e, OSError) and e.strerror else e}"
    near = state_dir
    while not os.path.isdir(near) and near not in ("", "/"):
        near = os.path.dirname(near.rstrip("/")) or "/"
    try:
        vfs = os.statvfs(near)
        why = ("read-only" if vfs.f_flag & os.ST_RDONLY else "full" if vfs.f_bavail == 0 else
               "not writable" if not os.access(near, os.W_OK) else "")
    except OSError as e:
        why = e.strerror or str(e)
    if why:
        return "unwritable", f"{near} is {why}: run-time limits and names would be refused"
    c = d.counts()
    return state, (f"{path}: {c['runs']} convgpu run, {c['limits']} limit set, {c['pods']} pod limits, "
                   f"{c['claims']} DRA claims" if state == "ok" else f"{path}: none yet")
