"""The tracer: one BPF program, probes on every CUDA library found (now or later), exact
per-(process, device) accounting read from maps, and events for the live view."""
import contextlib
import ctypes
import dataclasses
import logging
import os
import select
import time
from dataclasses import dataclass

from .. import phases
from . import detach, links, loader, untrusted
from .discovery import Discovery
from .events import EF_ORDINAL, FORMAT, Event, decode_many
from .gpumap import GPUMAP_ALSO, Mapper, bpf_entries
from .libs import SWEEP_BUDGET_S, Library, LibraryFinder, mapped_inodes
from .said import Said, container_of
from .table import CUDA, CUDART

log = logging.getLogger(__name__)
# How long after its bytes last changed a process may still have a free running in the driver:
# 4.5 GiB frees took up to 18 ms p99 on the H100; 0.5 s leaves room for far larger ones, and a
# process is then measured (NVML's sampler) once it has been quiet that long.
SETTLE_NS = 500_000_000


@dataclass(frozen=True)
class ProcUsage:
    """One (process, device) row of the BPF `usage` map, joined with its `procs` entry."""
    pid: int
    dev: int
    gen: int
    cgroup_id: int
    comm: str
    live: int
    peak: int
    n_alloc: int
    n_free: int
    bytes_alloc: int
    bytes_free: int
    n_failed: int
    contexts: int
    last_ns: int


class Tracer:
    kernel = True   # probes and BPF maps (probes/ledger.py is the other kind)

    def __init__(self, libraries: tuple[str, ...] = (), discover: bool = True,
                 ringbuf_pages: int = 4096, rescan_every: float = 1.0, selftest: bool = True,
                 sweep_every: float = 30.0, recheck: bool = False, cflags: tuple = (),
                 bpf_cache: str | None = None, runtime: bool = True):
        """runtime: also probe shared libcudart files. They only name the runtime call behind
        a driver call in events, for a view (bpf rt_mark); the driver's probes account and
        admit every call. The enforcer leaves them out (issue 32: four traps of a no-caching
        PyTorch pair's nine, for names no view may ask for)."""
        self.cflags = cflags
        self.owner = 0              # the enforcer's instance number (control.owner), if any
        self.bpf_cache = bpf_cache  # loader.compile_program(cache=): None default, "off"
        self.recheck = recheck
        self.finder = LibraryFinder(extra=tuple(libraries), discover=discover,
                                    kinds=(CUDA, CUDART) if runtime else (CUDA,))
        self.ringbuf_pages = ringbuf_pages
        self.rescan_every = rescan_every
        self.selftest = selftest
        # the enforcer's: libraries attached by start() are self-tested at the first poll(),
        # after admission is on (a self-test only reports: it gates nothing; ~0.1 s a driver)
        self.selftest_later = False
        self._untested: list[loader.LibraryProbes] = []
        self._starting = False
        self.sweep_every = sweep_every
        self.attached: list[loader.LibraryProbes] = []
        self.failed: list[tuple[Library, str]] = []
        self.b = None
        self._pending: list[Event] = []
        self._raw: list[bytes] = []
        self._ignore: set[int] = set()
        self._sweeps: set[tuple[int, int]] = set()
        self._last_scan = self._last_sweep = 0.0
        self.started_ns = 0
        self._fd = None
        self.selftest_exempt = lambda pid: contextlib.nullcontext()   # the enforcer's: admission skips pid
        self.on_release = lambda fds: None   # the enforcer's: its watchdog drops its duplicates of these links
        self.say = Said()                  # log lines a container can cause: rate-limited
        self.shims: tuple[str, ...] = ()   # the enforcer's shim libraries: never taken for drivers
        self.discovery = Discovery(self)   # enable_discovery(): stopped at open until probed
        # CUDA ordinals are process-local (probes/gpumap.py): the host GPUs (gpumap.gpus, from
        # NVML) of each process; `mapped`: processes whose ordinals BPF maps itself (the
        # enforcer's, map_gpus()); the others' events and rows are mapped here.
        self.gpumap = Mapper()
        self.mapped: set[int] = set()
        self.touch_fds: list[int] | None = None   # bpf/swap.bpf.c `touch` links, while a process is swapped

    # --- life cycle ---
    def start(self) -> "Tracer":
        self.b = loader.compile_program(ringbuf_pages=self.ringbuf_pages, extra=self.cflags, owner=self.owner,
                                        cache=self.bpf_cache)
        phases.mark("bpf", self.b.origin[0])
        self.b[b"events"].open_ring_buffer(self._on_event)
        # a successor over pinned maps: the processes its predecessor mapped are mapped in BPF
        self.mapped = {k.value >> 32 for k in self.b[b"gpumap"].keys() if k.value & GPUMAP_ALSO == GPUMAP_ALSO}
        self.started_ns = time.monotonic_ns()
        loader.preload(self.b, self.recheck)
        self._starting = True
        try:
            self.rescan(force=True)
        finally:
            self._starting = False
        phases.mark("probes")
        return self

    def enable_discovery(self, own_watchdog: bool = True) -> None:
        """Fail closed (probes/discovery.py): from now on a process that opens a driver file
        waits until that file is probed. With --no-discover, only the libraries given."""
        if self.finder.discover:
            self.discovery.enable(own_watchdog)

    def close(self, background: bool = False):
        """background: a child detaches the perf-event probes (probes/detach.py: ~0.1-0.5 s each,
        one at a time in the kernel), so that a command ends at once; that child, or None.
        Links (probes/links.py) are gone when this returns."""
        child = None
        if self.b is not None:
            self.discovery.disable()
            links.close(self.b)
            if background:
                child = detach.hand_off(self.b)
            self.b.cleanup()   # detaches the perf events left (handed off: at once)
            self._fd = None
            self.b = None
        for lib in list(self.finder.known.values()):
            self.let_go(lib)
        return child

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()

    # --- libraries ---
    def fileno(self) -> int:
        """Readable when the ring buffer has data after a wake-up (libbpf's epoll fd), so a
        loop can sleep in select() and still react to a stall at once."""
        if self._fd is None:
            lib = ctypes.CDLL("libbpf.so.1")
            lib.ring_buffer__epoll_fd.restype = ctypes.c_int
            lib.ring_buffer__epoll_fd.argtypes = [ctypes.c_void_p]
            self._fd = lib.ring_buffer__epoll_fd(self.b._ringbuf_manager)
        return self._fd

    def rescan(self, force: bool = False) -> list[loader.LibraryProbes]:
        now = time.monotonic()
        if not force and now - self._last_scan < self.rescan_every:
            return []
        self._last_scan = now
        added = []
        for lib in self.finder.scan():
            if not force:   # found by a later scan: attached by the loop, a few a pass (row 7)
                self.discovery.queue(lib)
                continue
            lp = self.attach(lib)
            if lp is not None:
                added.append(lp)
        return added

    def attach(self, lib: Library, container: str | None = None, syms=None) -> loader.LibraryProbes | None:
        """Probes on lib, verified by reading it (and self-tested if it is the host's own: a
        required probe that never fired is then a failure too); a failure is recorded in
        `failed` (one bad library must not stop tracing the others). container: whose open
        found it (discovery): its log lines are then one per container and kind, as a container
        can bring copies by the hundred (issue 24 row 7). syms: loader.symbols_of(lib), read off
        the loop (probes/reading.py), or the exception that reading raised."""
        try:
            with phases.timed("attach"):
                lp = loader.attach_library(self.b, lib, recheck=self.recheck, syms=syms)
        except Exception as e:
            self.failed.append((self.let_go(lib), str(e)))
            if container is None:   # else discovery says it, with the opener and what it does to it
                log.warning("%s: %s", lib, e)
            return None
        if self.selftest and self.selftest_later and self._starting:
            self._untested.append(lp)
        elif self.selftest:
            self._self_test(lp)
        self.attached.append(lp)
        self._say(logging.INFO, container, "attached", "probes attached to %s (%d symbols%s)", lib,
                  sum(a.ok for a in lp.probes), "" if lib.trusted else ", verified by reading it")
        return lp

    def _self_test(self, lp: loader.LibraryProbes) -> None:
        with phases.timed("self-test"):
            pid = loader.self_test(self.b, lp, self._exempt)
        if pid:
            self._ignore.add(pid)
        silent = [a.probe.symbol for a in lp.probes if a.probe.required and a.fired is False]
        if silent:
            self.failed.append((lp.library, f"required probes never fired in the self-test: {', '.join(silent)}"))
            log.warning("%s: required probes never fired in the self-test: %s", lp.library, ", ".join(silent))

    def _say(self, level, container, kind, msg, *args):
        if container is None:
            log.log(level, msg, *args)
        else:
            self.say(level, (container, kind), msg, *args)

    def let_go(self, lib: Library) -> Library:
        """Our descriptor of a library nothing is attached to is closed (its inode and why are
        all we keep); the copy without it, also in finder.known."""
        untrusted.close(lib.fd)
        lib = dataclasses.replace(lib, fd=-1)
        if lib.inode in self.finder.known:
            self.finder.known[lib.inode] = lib
        return lib

    def touch(self, on: bool) -> int:
        """`touch` on the drivers' most used entry points (table.TOUCH), while some process is
        swapped (enforcer/swap/), else off: a launch pays no trap for it. Returns the probes on."""
        if on and self.touch_fds is None:
            self.touch_fds = []
            for lp in self.attached:
                if lp.library.kind != CUDA or lp.library.fd < 0:
                    continue
                try:
                    self.touch_fds += loader.attach_touch(self.b, lp.library)
                except Exception as e:   # a copy that cannot be read now: its process's calls block unheard
                    log.warning("%s: cannot attach the swap probes (%s): a swapped process of it comes back "
                                "only by an admitted call or `convgpu swap in`", lp.library, e)
        elif not on and self.touch_fds is not None:
            fds, self.touch_fds = self.touch_fds, None
            self.on_release(fds)
            links.release(self.b, fds)
        return len(self.touch_fds or ())

    def failure(self, inode) -> str | None:
        """Why the library of this inode could not be probed, or None (probed, or unknown)."""
        return next((err for f, err in self.failed if f.inode == inode), None)

    def _release_unused(self) -> None:
        """Driver copies that discovery or a scan found and that no live process opened or maps
        any more lose their probes, their descriptor and their entries (issue 24 row 7: many
        copies must not pile up links and lists); a later open finds one again. The host's
        own driver and the libraries given on the command line stay."""
        idle = [lib for lib in self.finder.known.values()
                if not lib.trusted and lib.seen_as not in self.finder.extra and not self.discovery.in_use(lib.inode)]
        if not idle:
            return
        mapped = mapped_inodes(self.finder.proc)
        if mapped is None:      # not read within its budget: keep them (they cost links, not safety)
            log.warning("the maps of this host's processes took over %.1f s to read: unused driver "
                        "copies are kept until a sweep reads them all", SWEEP_BUDGET_S)
            return
        gone = {lib.inode for lib in idle if lib.inode[1] not in mapped}
        if not gone:
            return
        mine = [lp for lp in self.attached if lp.library.inode in gone]
        fds = [fd for lp in mine for fd in lp.link_fds]
        self.on_release(fds)
        links.release(self.b, fds)
        self.attached = [lp for lp in self.attached if lp.library.inode not in gone]
        self.failed = [(lib, err) for lib, err in self.failed if lib.inode not in gone]
        for inode in gone:
            untrusted.close(self.finder.known.pop(inode).fd)
            self.discovery.forget(inode)
        log.info("%d driver copies no process uses any more: %d probes detached", len(gone), len(fds))

    @contextlib.contextmanager
    def _exempt(self, pid: int):
        """The self-test child: neither admitted (the enforcer's) nor stopped at its open."""
        with self.discovery.exempting(pid), self.selftest_exempt(pid):
            yield

    @property
    def libraries(self) -> list[Library]:
        return [lp.library for lp in self.attached]

    # --- events ---
    def _on_event(self, ctx, data, size):
        # Only copy here (called once per event from C); decoding is batched in poll().
        self._raw.append(ctypes.string_at(data, FORMAT.size))

    def poll(self) -> list[Event]:
        """Everything since the last poll; also attaches new libraries and cleans up. The
        housekeeping comes first, for what earlier polls found: an exit reaches the caller
        (the enforcer resumes a waiter on it) without waiting for its own sweep."""
        self.discovery.beat()
        while self._untested:
            self._self_test(self._untested.pop(0))
        self.rescan()
        now = time.monotonic()
        if self._sweeps or now - self._last_sweep > self.sweep_every:
            self._sweep(full=now - self._last_sweep > self.sweep_every)
            self._last_sweep = now if now - self._last_sweep > self.sweep_every else self._last_sweep
        self._consume()
        if self.discovery.work():   # what the new probes (and a self-test) saw meanwhile, too
            self._consume()
        out, self._pending = self._pending, []
        return out

    def _consume(self) -> None:
        self.b.ring_buffer_consume()
        raw, self._raw = self._raw, []
        for ev in decode_many(b"".join(raw)):
            if ev.op == "lib_open":     # size 1: an open of a GPU node (probes/identity.py)
                if ev.size == 1:
                    self.discovery.identity.opened(ev.pid, ev.tid, ev.addr, container_of(ev.pid))
                else:
                    self.discovery.opened(ev.pid, ev.tid, ev.addr)
                continue
            if ev.op in ("exit", "exec"):
                self._sweeps.add((ev.pid, ev.addr))   # addr carries the process generation
                self.gpumap.forget(ev.pid)
                self.mapped.discard(ev.pid)
            elif ev.pid in self._ignore:    # our own self-test children: never mapped (nor said)
                continue
            elif ev.dev >= 0 and self.gpumap.gpus and ev.pid not in self.mapped and not ev.flags & EF_ORDINAL:
                ev = ev._replace(dev=self.gpumap.host(ev.pid, ev.dev))
            if ev.pid not in self._ignore:
                self._pending.append(ev)

    def wait(self, timeout: float) -> None:
        """Sleep until an event that wakes (a stop at a driver's open, a stall), a file read
        off the loop (probes/reading.py), or timeout."""
        reader = self.discovery.reader
        if reader.fd in select.select([self.fileno(), reader.fd], [], [], timeout)[0]:
            reader.drain()

    def _sweep(self, full: bool) -> None:
        """Drop objects of processes that are gone. Their bytes already left the totals in
        BPF at exit; this only frees map slots (an exit event lost to a full ring buffer is
        caught by the periodic full sweep, which keeps objects of live generations only)."""
        objs = self.b[b"objs"]
        live = {k.value: v.gen for k, v in self.b[b"procs"].items()} if full else None
        dead = []
        for k, v in objs.items():
            if (k.tgid, v.gen) in self._sweeps or (full and live.get(k.tgid) != v.gen):
                dead.append((k, v.quota))
        gone: dict[int, int] = {}
        for k, quota in dead:
            try:
                del objs[k]
            except KeyError:
                continue
            if quota:
                gone[quota] = gone.get(quota, 0) + 1
        self._swept(gone)
        self._sweeps.clear()
        if full:    # an exit event lost to a full ring buffer: its pid is mapped no more
            self.mapped = {p for p in self.mapped if os.path.exists(f"/proc/{p}")}
        self.discovery.sweep()
        if full:
            self._release_unused()

    def map_gpus(self, pid: int, charge_also: bool = True):
        """Write pid's ordinal -> host GPU rows into BPF's gpumap (bpf/books.bpf.c host_of());
        the enforcer calls it while pid is stopped at its placement, before its first charge.
        charge_also: a mapping the evidence did not fix charges every GPU it may use."""
        self.gpumap.forget(pid)     # read now, not what an earlier look at this pid saw
        m = self.gpumap.of(pid)
        t = self.b[b"gpumap"]
        for key, host, also in bpf_entries(pid, m, charge_also):
            t[ctypes.c_uint64(key)] = t.Leaf(host, also)
        self.mapped.add(pid)
        return m

    def _swept(self, gone: dict[int, int]) -> None:
        """The objects just deleted leave their containers' quotas (bpf/books.bpf.c, q_left):
        counted in `swept`, which only this writes, so BPF's own counters never race with it."""
        quotas, swept = self.b[b"quotas"], self.b[b"swept"]
        for key, n in gone.items():
            k = ctypes.c_ulonglong(key)
            if k not in quotas:     # the container is gone, and its bucket with it
                continue
            try:
                old = swept[k].value
            except KeyError:
                old = 0
            swept[k] = ctypes.c_ulonglong(old + n)

    # --- accounting ---
    def usage(self) -> list[ProcUsage]:
        procs = {k.value: v for k, v in self.b[b"procs"].items()}
        rows = []
        for k, u in self.b[b"usage"].items():
            p = procs.get(k.tgid)
            if p is None or p.gen != u.gen or k.tgid in self._ignore:
                continue
            dev = k.dev
            if self.gpumap.gpus and k.tgid not in self.mapped:
                dev = self.gpumap.host(k.tgid, dev)
            rows.append(ProcUsage(
                pid=k.tgid, dev=dev, gen=u.gen, cgroup_id=p.cgroup_id,
                comm=p.comm.decode(errors="replace"), live=u.live, peak=u.peak,
                n_alloc=u.n_alloc, n_free=u.n_free, bytes_alloc=u.bytes_alloc,
                bytes_free=u.bytes_free, n_failed=u.n_failed, contexts=u.contexts,
                last_ns=u.last_ns))
        return sorted(rows, key=lambda r: (r.pid, r.dev))

    def calls_in_flight(self, settle_ns: int = SETTLE_NS) -> set[int]:
        """Pids with a driver call that may be running: between its entry and its return probe,
        and not stalled at its entry (a process the enforcer holds there is stopped before the
        call's body, so what the driver counts for it does not move); and, with settle_ns, pids
        whose bytes changed that recently (the driver's own count may trail a return). A free
        is in flight from its entry to its return (`freeing`: settled there, bpf exit_free)."""
        running = {k.value >> 32 for k, t in self.b[b"threads"].items()
                   if (t.call.api and not t.call.stalled) or t.freeing}
        if not settle_ns:
            return running
        since = time.monotonic_ns() - settle_ns     # bpf_ktime_get_ns is CLOCK_MONOTONIC too
        return running | {k.tgid for k, u in self.b[b"usage"].items() if u.last_ns > since}

    def stats(self) -> dict[str, int]:
        names = ("drops", "unknown_free", "unchecked", "unrecorded", "over_quota")   # enum cg_stat
        return {n: sum(v) for n, (k, v) in zip(names, sorted(self.b[b"stats"].items(), key=lambda kv: kv[0].value))}

    def object_count(self) -> int:
        return len(self.b[b"objs"].items())
