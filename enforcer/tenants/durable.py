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
run dir) reads it but refuses every decision. The value and its format (Decisions, encode,
decode) are tenants/decisionfile.py, which touches no file; Store, here, is the only part that
touches one (tests/unit/test_durable.py)."""
import fcntl
import logging
import os
import stat
import time

from ...faults import FAULT
from .cgroupfs import cgroup_layout
from .decisionfile import FILE, MAX_BYTES, Decisions, NotKept, decode, encode
from .statefile import Unreadable, read_file, write_whole

log = logging.getLogger(__name__)
LOCK_WAIT = 1.0          # s a start waits for the state dir's lock (a predecessor still exiting)


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
