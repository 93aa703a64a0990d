"""What the enforcer runs on where eBPF is not available (no CAP_BPF, no uprobes, a locked-down
kernel): `convgpu enforce --no-probes`. It has the tracer's face (tables, poll, usage) so the
enforcer's code is the same in both modes, but its tables are Python dicts, fed by what the
preload shims report (enforcer/serving/broker.py): their allocations, frees and contexts. Only processes
under the shim are seen, and nothing is ever stopped: a shim waits in the calling thread or
gets an out-of-memory error. Exits come from pidfds, so a process that dies without a word
leaves its container at once, as the kernel's exit probe does in BPF mode; execs from the
kernel's process connector (probes/procevents.py), so a new image starts empty, as BPF's exec
tracepoint makes it, and is placed again at its own hello."""
import contextlib
import os
import select
import time
from collections import namedtuple
from dataclasses import dataclass
from types import SimpleNamespace

from .events import Event
from .gpumap import Mapper
from .procevents import ProcEvents, image_of
from .tracer import ProcUsage

IMAGE_CHECK_S = 1.0     # without the connector (or after it lost events): images compared this often
DEV_PAGE = 2 << 20      # as bpf/maps.bpf.c: device page of linear allocations
SUBALLOC_MAX = 1 << 20  # at most this is sub-allocated inside shared pages
SHIM_MEMBER = 1 << 63   # bpf/convgpu.h: the membership flag of processes under the shim


def footprint(size: int) -> int:
    """Device memory behind an allocation of `size` (bpf/admit.bpf.c footprint(); measured
    on the H100: docs/gpu-runs/2026-11-22)."""
    return (size + DEV_PAGE - 1) & ~(DEV_PAGE - 1) if size > SUBALLOC_MAX else size


class Table(dict):
    """A BPF hash map's face over a dict: Key and Leaf constructors, ctypes keys by value."""

    def __init__(self, key_fields: tuple[str, ...], leaf_fields: tuple[str, ...]):
        super().__init__()
        self.Key = namedtuple("Key", key_fields) if key_fields else None
        self.Leaf = lambda **kw: SimpleNamespace(**{**dict.fromkeys(leaf_fields, 0), **kw})

    @staticmethod
    def _k(k):
        return getattr(k, "value", k)

    def __getitem__(self, k):
        return super().__getitem__(self._k(k))

    def __setitem__(self, k, v):
        super().__setitem__(self._k(k), v)

    def __delitem__(self, k):
        super().__delitem__(self._k(k))

    def get(self, k, default=None):
        return super().get(self._k(k), default)


@dataclass
class _Row:
    live: int = 0
    peak: int = 0
    n_alloc: int = 0
    n_free: int = 0
    bytes_alloc: int = 0
    bytes_free: int = 0
    contexts: int = 0
    last_ns: int = 0


class Ledger:
    kernel = False   # the enforcer skips what needs probes: pinned maps, the watchdog, probe fds

    def __init__(self):
        self.b = None
        self.libraries: list = []
        self.cflags: tuple = ()
        self.recheck = False
        self.selftest_exempt = lambda pid: contextlib.nullcontext()
        self.rows: dict[int, dict[int, _Row]] = {}   # pid -> device -> counters
        self.primary: set[tuple[int, int]] = set()   # (pid, device): primary context counted
        self.comm: dict[int, str] = {}
        self._fds: dict[int, int] = {}               # pidfd -> pid
        self._images: dict[int, tuple | None] = {}   # pid -> image_of(pid) when last seen
        self._ep = None
        self._pe: ProcEvents | None = None
        self._checked = 0.0                          # last comparison of every image
        self._events: list[Event] = []
        self.gpumap = Mapper()   # the shim's CUDA ordinals are the process's own (probes/gpumap.py)

    # --- the tracer's face ---
    def start(self) -> "Ledger":
        self.b = {b"control": Table((), ("heartbeat_ns", "ctx_overhead", "enforcing", "over_limit_kill",
                                         "waiters", "owner", "quiet", "exempt")),
                  b"assign": Table(("container", "dev"), ("limit", "assigned", "extra_overhead", "adopted",
                                                          "adopted_contexts", "ctx_charge", "torn")),
                  b"cgstate": Table(("container", "dev"), ("used", "reserved", "contexts", "stalls", "tearing")),
                  b"members": Table((), ()),
                  b"quotas": Table((), ("objs", "threads", "procs", "denied")), b"swept": Table((), ())}
        self._ep = select.epoll()
        self._pe = ProcEvents().open()
        if self._pe is not None:
            self._ep.register(self._pe.fileno(), select.EPOLLIN)
        return self

    def close(self, background: bool = False) -> None:   # nothing to detach (probes/tracer.py's)
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()
        if self._pe is not None:
            self._pe.close()
        if self._ep is not None:
            self._ep.close()
        self.b = None

    @property
    def mapped(self) -> set[int]:
        """Processes whose GPUs were read (at their first message naming a device), as the
        tracer's `mapped`: those placed in BPF's gpumap."""
        return set(self.gpumap.cache)

    def fileno(self) -> int:
        return self._ep.fileno()   # readable when a watched process exits or anything execs

    def poll(self) -> list[Event]:
        lost = self._pe is None
        for fd, _ in self._ep.poll(0):
            if self._pe is not None and fd == self._pe.fileno():
                execs, lost = self._pe.read()
                for pid in execs:
                    self.exec_seen(pid)
            elif fd in self._fds:
                self._exit(self._fds[fd], fd)
        now = time.monotonic()
        if lost and now - self._checked >= IMAGE_CHECK_S:   # an exec we were not told of
            self._checked = now
            for pid in list(self._images):
                self.exec_seen(pid)
        out, self._events = self._events, []
        return out

    def exec_seen(self, pid: int) -> Event | None:
        """If pid runs another image than when last seen (it exec'd): the old image's rows are
        released now and the exec event is returned (and queued for poll()). The broker asks this
        before each shim message, so a new image's hello, which may come before the connector's
        event is read, never lands in the old image's books."""
        image = image_of(pid)
        if pid not in self._images or image in (self._images[pid], None):
            return None
        self._images[pid] = image
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/comm") as f:
                self.comm[pid] = f.read().strip()
        return self._release(pid, "exec")

    def usage(self) -> list[ProcUsage]:
        return [ProcUsage(pid=pid, dev=dev, gen=0, cgroup_id=0, comm=self.comm.get(pid, ""), live=r.live,
                          peak=r.peak, n_alloc=r.n_alloc, n_free=r.n_free, bytes_alloc=r.bytes_alloc,
                          bytes_free=r.bytes_free, n_failed=0, contexts=r.contexts, last_ns=r.last_ns)
                for pid, devs in sorted(self.rows.items()) for dev, r in sorted(devs.items())]

    def stats(self) -> dict[str, int]:
        return {"drops": 0, "unknown_free": 0, "unchecked": 0, "unrecorded": 0, "over_quota": 0}

    def calls_in_flight(self) -> set[int]:
        return set()   # the shims report a call once it returned

    # --- what the shims report (enforcer/serving/broker.py) ---
    def watch(self, pid: int) -> None:
        """A process said hello: follow it to its exit."""
        if pid in self._fds.values():
            return
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            return
        self._fds[fd] = pid
        self._ep.register(fd, select.EPOLLIN)
        self._images[pid] = image_of(pid)
        try:
            with open(f"/proc/{pid}/comm") as f:
                self.comm[pid] = f.read().strip()
        except OSError:
            pass

    def context(self, pid: int, dev: int, primary: bool) -> None:
        """A context was made: the primary one counts once per process and device, as in BPF."""
        if primary:
            if (pid, dev) in self.primary:
                return
            self.primary.add((pid, dev))
        self._row(pid, dev).contexts += 1
        self._charge(pid, dev, 0, 1)

    def alloc(self, pid: int, dev: int, size: int) -> None:
        n = footprint(size)
        r = self._row(pid, dev)
        r.live += n
        r.peak = max(r.peak, r.live)
        r.n_alloc += 1
        r.bytes_alloc += n
        self._charge(pid, dev, n, 0)
        self._event(pid, "alloc", dev, n, r.live)

    def free(self, pid: int, dev: int, size: int) -> None:
        n = footprint(size)
        r = self._row(pid, dev)
        n = min(n, r.live)
        r.live -= n
        r.n_free += 1
        r.bytes_free += n
        self._charge(pid, dev, -n, 0)
        self._event(pid, "free", dev, n, r.live)

    # --- inside ---
    def _row(self, pid: int, dev: int) -> _Row:
        r = self.rows.setdefault(pid, {}).setdefault(dev, _Row())
        r.last_ns = time.monotonic_ns()
        return r

    def _charge(self, pid: int, dev: int, nbytes: int, contexts: int) -> None:
        """The container's counters, as BPF keeps them: only once the enforcer made its entry."""
        member = self.b[b"members"].get(pid)
        if member is None:
            return
        key = getattr(member, "value", member) & ~SHIM_MEMBER
        st = self.b[b"cgstate"].get(self.b[b"cgstate"].Key(container=key, dev=dev))
        if st is not None:
            st.used = max(0, st.used + nbytes)
            st.contexts = max(0, st.contexts + contexts)

    def _exit(self, pid: int, fd: int) -> None:
        self._ep.unregister(fd)
        os.close(fd)
        del self._fds[fd]
        self._images.pop(pid, None)
        self._release(pid, "exit")
        self.comm.pop(pid, None)

    def _release(self, pid: int, op: str) -> Event:
        """Everything pid held leaves its container, and an event says so, as BPF's exit and exec
        tracepoints do (process_gone in bpf/exit.bpf.c)."""
        left = contexts = 0
        for dev, r in self.rows.pop(pid, {}).items():
            self._charge(pid, dev, -r.live, -r.contexts)
            left += r.live
            contexts += max(r.contexts, 0)
        self.primary = {p for p in self.primary if p[0] != pid}
        self.b[b"members"].pop(pid, None)
        self.gpumap.forget(pid)   # a new image reads its environment and device nodes anew
        return self._event(pid, op, -1, left, contexts)

    def _event(self, pid: int, op: str, dev: int, size: int, live: int) -> Event:
        e = Event(time.monotonic_ns(), pid, pid, self.comm.get(pid, ""), 0, op, "shim", None, dev, 0, size, live, 0, 0)
        self._events.append(e)
        return e
