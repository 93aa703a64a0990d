"""Per (container, process, GPU) accounting: exact live bytes from the BPF maps, plus the CUDA
context overhead that no allocation call shows.

Context overhead (FACTS.md): a process holding one 123 MiB allocation shows 642 MiB in
nvidia-smi on an H100 with driver 580, so ~519 MiB per process is context, module code and
reserves; lazy module loading makes it grow as kernels are first used. So it is *measured*
where NVML is present (NVML's per-process used memory minus the tracked live bytes), and
estimated per device otherwise: the median of recent measurements on that device, else the
--ctx-overhead value (default 519 MiB, the H100 / driver 580 measurement)."""
import logging
import statistics
import time
from collections import defaultdict, deque

from ..probes.events import Event
from .tenants import containers as ct
from .model import ContainerRow, GpuRow, ProcessRow, Snapshot

log = logging.getLogger(__name__)

MiB = 1 << 20
DEFAULT_CTX_OVERHEAD = 519 * MiB


class Accountant:
    def __init__(self, nvml=None, ctx_overhead: int | None = None, engines=None,
                 keep_events: int = 200, container_of_pid=ct.container_of_pid):
        self.nvml = nvml
        self.ctx_overhead = DEFAULT_CTX_OVERHEAD if ctx_overhead is None else ctx_overhead
        self.engines = engines
        self.recent: deque[Event] = deque(maxlen=keep_events)
        self.events_total = 0
        self._container_of_pid = container_of_pid
        self._containers: dict[int, ct.Container] = {}
        self._plive: dict[tuple[int, int], int] = {}
        self._clive: dict[str, int] = defaultdict(int)
        self._cpeak: dict[str, int] = defaultdict(int)
        self._measured: dict[int, deque] = defaultdict(lambda: deque(maxlen=32))
        self._prev: dict[tuple[int, int, int], tuple[int, float]] = {}
        self._nvml_said: set[str] = set()   # the kinds of NVML error the view has logged

    # --- containers ---
    def container(self, pid: int, refresh: bool = False) -> ct.Container:
        """Cached per pid between snapshots; each snapshot re-reads (a process can be moved
        into another cgroup after it started, e.g. by `convgpu run`)."""
        c = None if refresh else self._containers.get(pid)
        if c is None:
            try:
                c = self._container_of_pid(pid)
            except Exception:   # gone already: keep it apart rather than guess
                c = ct.Container(kind="cgroup", id=f"exited:{pid}", cgroup="?", pod=None)
            self._containers[pid] = c
        return c

    # --- events ---
    def feed(self, events: list[Event]) -> None:
        for e in events:
            self.events_total += 1
            self.recent.append(e)
            if e.op in ("alloc", "free") and e.size and not e.unknown:
                key = (e.pid, e.dev)
                cid = self.container(e.pid).id
                self._clive[cid] += e.live - self._plive.get(key, 0)
                self._plive[key] = e.live
                self._cpeak[cid] = max(self._cpeak[cid], self._clive[cid])
            elif e.op in ("exit", "exec"):
                c = self._containers.pop(e.pid, None)
                for key in [k for k in self._plive if k[0] == e.pid]:
                    if c is not None:
                        self._clive[c.id] -= self._plive[key]
                    del self._plive[key]

    # --- overhead ---
    def estimate(self, dev: int) -> int:
        m = self._measured.get(dev)
        return int(statistics.median(m)) if m else self.ctx_overhead

    def _overhead(self, u, nvml_used: int | None) -> tuple[int, str]:
        if nvml_used is not None:
            measured = max(0, nvml_used - u.live)
            if u.contexts > 0:
                self._measured[u.dev].append(measured)
            return measured, "nvml"
        if u.contexts > 0:
            return self.estimate(u.dev) * u.contexts, "estimate"
        return 0, "none"

    def _nvml_facts(self) -> tuple[dict, list]:
        """NVML's per-process memory and GPUs for a snapshot; where NVML cannot give them (a GPU
        lost, per-process lists NotSupported: MIG, some cards) the view goes on without its
        figures, contexts shown at their estimate, and says why once per kind of error."""
        if self.nvml is None or not self.nvml.ok:
            return {}, []
        out = []
        for read in (self.nvml.process_memory, self.nvml.gpus):
            try:
                out.append(read())
            except Exception as e:   # pynvml's NVMLError_*: one line per kind, not per snapshot
                if type(e).__name__ not in self._nvml_said:
                    self._nvml_said.add(type(e).__name__)
                    log.warning("NVML %s: %s; the view goes on without it (contexts at their estimate)",
                                read.__name__, e or type(e).__name__)
                out.append({} if read == self.nvml.process_memory else [])
        return out[0], out[1]

    # --- snapshot ---
    def snapshot(self, usage, mode: str = "driver", libraries=(), drops: int = 0,
                 pids: set[int] | None = None, container: str | None = None,
                 notes=()) -> Snapshot:
        now_mono, now = time.monotonic(), time.time()
        per_proc, gpus = self._nvml_facts()
        groups: dict[str, list[ProcessRow]] = defaultdict(list)
        meta: dict[str, ct.Container] = {}
        tracked: dict[int, int] = defaultdict(int)
        for u in usage:
            c = self.container(u.pid, refresh=True)
            nv = per_proc.get((u.pid, u.dev))
            overhead, src = self._overhead(u, nv)
            prev = self._prev.get((u.pid, u.dev, u.gen))
            rate = 0.0
            if prev and now_mono > prev[1]:
                rate = (u.n_alloc - prev[0]) / (now_mono - prev[1])
            self._prev[(u.pid, u.dev, u.gen)] = (u.n_alloc, now_mono)
            row = ProcessRow(
                pid=u.pid, comm=_comm(u.pid, u.comm), gpu=u.dev, live=u.live, peak=u.peak,
                overhead=overhead, overhead_source=src, contexts=u.contexts, allocs=u.n_alloc,
                frees=u.n_free, failed=u.n_failed, rate=rate,
                last_event_age=(now_mono * 1e9 - u.last_ns) / 1e9 if u.last_ns else None,
                nvml_used=nv)
            tracked[u.dev] += row.total
            if pids and u.pid not in pids:
                continue
            if container and not matches(c, container, self._name(c)):
                continue
            groups[c.id].append(row)
            meta[c.id] = c
        live_keys = {(u.pid, u.dev, u.gen) for u in usage}
        self._prev = {k: v for k, v in self._prev.items() if k in live_keys}

        rows = []
        for cid, procs in groups.items():
            c = meta[cid]
            live = sum(p.live for p in procs)
            self._clive[cid] = live if not pids else self._clive[cid]
            self._cpeak[cid] = max(self._cpeak[cid], live)
            info = self.engines.lookup(c) if self.engines is not None else None
            rows.append(ContainerRow(
                id=c.id, name=self._name(c), kind=c.kind, cgroup=c.cgroup,
                processes=tuple(sorted(procs, key=lambda p: (p.pid, p.gpu))),
                peak=self._cpeak[cid], labels=dict(info.labels) if info else {}))
        rows.sort(key=lambda r: (-r.total, r.name))

        devs = sorted({g.index for g in gpus} | set(tracked))
        by_index = {g.index: g for g in gpus}
        gpu_rows = tuple(
            GpuRow(index=d, name=by_index[d].name if d in by_index else f"GPU {d} (no NVML)",
                   total=by_index[d].total if d in by_index else None,
                   used=by_index[d].used if d in by_index else None, tracked=tracked.get(d, 0))
            for d in devs)
        return Snapshot(ts=now, mode=mode, gpus=gpu_rows, containers=tuple(rows),
                        events=tuple(self.recent), events_total=self.events_total, drops=drops,
                        libraries=tuple(libraries), notes=tuple(notes))

    def _name(self, c: ct.Container) -> str:
        info = self.engines.lookup(c) if self.engines is not None else None
        return info.name if info and info.name else c.short


def matches(c: ct.Container, wanted: str, name: str | None = None) -> bool:
    """--container accepts an id (or prefix of 6+ chars), a short id, a name, or a cgroup path."""
    return (wanted in (c.id, c.short, c.cgroup, name)
            or (len(wanted) >= 6 and c.id.startswith(wanted)))


def _comm(pid: int, fallback: str) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip() or fallback
    except OSError:
        return fallback
