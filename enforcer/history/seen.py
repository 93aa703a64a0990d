"""What the recorder is handed once a second: per container, a plain Seen built from what is
already counted, by the enforcer's books (from_books) or by `convgpu trace`'s accounting
(from_snapshot). Nothing here reads a BPF map or NVML itself: the callers pass what they hold
(the probes' per-process rows, NVML's measured context overheads)."""
from dataclasses import dataclass

from .jobs import Job, identify

HUGE = 1 << 62   # BPF's `used` may wrap below zero for a moment (bpf/books.bpf.c charged())


@dataclass(frozen=True)
class GpuSeen:
    """A container on one GPU now: what it holds (allocations and context charge), its
    allocations, its context charge, its limit and assignment there (None: none), the wall
    clock its wait began (None: not waiting), and its demand: what it holds with the calls it is
    stopped at (what it would hold, had they been admitted: a job held at its limit shows here
    what it asked beyond it)."""
    held: int
    used: int
    ctx: int
    contexts: int
    limit: int | None = None
    assigned: int | None = None
    wait_since: float | None = None
    demand: int = 0


@dataclass(frozen=True)
class ProcSeen:
    """A process on one GPU: BPF's peak of its live bytes (exact, kept by the probes at every
    allocation), its context charge now (NVML's measurement, else the estimate each), its
    contexts and its allocation calls so far."""
    pid: int
    gen: int
    dev: int
    peak: int
    ctx: int
    contexts: int
    allocs: int


@dataclass(frozen=True)
class Seen:
    key: str                 # the container (its id): a run is one container's life
    job: Job
    container: str           # shown to the reader
    limit: int | None
    source: str
    gpus: dict               # dev -> GpuSeen
    procs: tuple = ()        # ProcSeen
    stalls: int = 0
    stalled_s: float = 0.0
    over_limits: int = 0
    since: float | None = None   # wall clock the container was first seen (None: at this sample)


def from_books(books, usage, excess: dict, ctx_of, run_names: dict, rules, mono: float, wall: float) -> list[Seen]:
    """The enforcer's containers (enforcer/books.py Books): usage, the probes' rows
    (Tracer.usage()); excess, (pid, dev) -> (NVML's measured overhead, contexts);
    ctx_of(dev), the charge per unmeasured context; run_names, cgroup -> `convgpu run --name`;
    rules.pod_limit(container), the Kubernetes agent's entry (its job); mono/wall: now."""
    rows: dict = {}
    for u in usage:
        rows.setdefault(u.pid, []).append(u)
    out = []
    for box in books.boxes.values():
        c = box.container
        gpus = {}
        for dev in sorted(box.assigned):
            used, contexts, _ = books.usage(box, dev)
            w = box.waiting.get(dev)
            held = books.held(box, dev)   # demand: with the calls it is stopped at (not books.demand, which
            #                             also counts calls in flight, and a resumed one twice for a moment)
            gpus[dev] = GpuSeen(held, used if used < HUGE else 0, books.ctx_held(box, dev, 0, contexts),
                                contexts, books.limit(box, dev), box.assigned[dev],
                                None if w is None else wall - (mono - w.since),
                                held + (sum(a.size for a in w.asks.values()) + w.unreserved if w else 0))
        procs = tuple(ProcSeen(u.pid, u.gen, u.dev, u.peak, excess[(u.pid, u.dev)][0] if (u.pid, u.dev) in excess
                               else max(u.contexts, 0) * ctx_of(u.dev), max(u.contexts, 0), u.n_alloc)
                      for pid in sorted(box.pids) for u in rows.get(pid, ()))
        pod = rules.pod_limit(c, rules.budget(box.claims))   # a DRA claim's budget: the claim is the job
        job = identify(c.kind, c.id, c.cgroup, box.name, run_names.get(c.cgroup), getattr(pod, "job", "") or "")
        out.append(Seen(c.id, job, c.cgroup if c.kind in ("cgroup", "host") else c.short, box.limit, box.source,
                        gpus, procs, box.stalls, box.stalled_s + sum(mono - w.since for w in box.waiting.values()),
                        box.over_limits, wall - (mono - box.created)))
    return out


def from_snapshot(snap) -> list[Seen]:
    """`convgpu trace`'s containers (enforcer/model.py Snapshot): no limits, no waits."""
    out = []
    for c in snap.containers:
        gpus: dict = {}
        for p in c.processes:
            g = gpus.get(p.gpu, GpuSeen(0, 0, 0, 0))
            gpus[p.gpu] = GpuSeen(g.held + p.total, g.used + p.live, g.ctx + p.overhead,
                                  g.contexts + max(p.contexts, 0))
        procs = tuple(ProcSeen(p.pid, 0, p.gpu, p.peak, p.overhead, max(p.contexts, 0), p.allocs)
                      for p in c.processes)
        shown = c.cgroup if c.kind in ("cgroup", "host") else c.name
        out.append(Seen(c.id, identify(c.kind, c.id, c.cgroup, c.name), shown, None, "", gpus, procs))
    return out
