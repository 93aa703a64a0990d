"""What a view shows: plain snapshot dataclasses, built by accounting.py, rendered by
cli/view.py and serialised for `convgpu trace --json` (schema in docs/trace-json.md)."""
from dataclasses import asdict, dataclass, field

SNAPSHOT_SCHEMA = 1


@dataclass(frozen=True)
class ProcessRow:
    pid: int
    comm: str
    gpu: int
    live: int                  # bytes held now (exact, from the BPF maps)
    peak: int
    overhead: int              # CUDA context overhead on this GPU
    overhead_source: str       # "nvml" (measured), "estimate" (per-device), "none" (no context)
    contexts: int
    allocs: int                # cumulative successful allocation calls
    frees: int
    failed: int                # calls that returned an error (not accounted)
    rate: float                # allocations per second over the last interval
    last_event_age: float | None  # seconds since the last event
    nvml_used: int | None = None

    @property
    def total(self) -> int:
        return self.live + self.overhead


@dataclass(frozen=True)
class ContainerRow:
    id: str
    name: str
    kind: str
    cgroup: str
    processes: tuple[ProcessRow, ...]
    peak: int
    labels: dict = field(default_factory=dict)

    @property
    def live(self) -> int:
        return sum(p.live for p in self.processes)

    @property
    def overhead(self) -> int:
        return sum(p.overhead for p in self.processes)

    @property
    def total(self) -> int:
        return self.live + self.overhead

    @property
    def rate(self) -> float:
        return sum(p.rate for p in self.processes)

    @property
    def last_event_age(self) -> float | None:
        ages = [p.last_event_age for p in self.processes if p.last_event_age is not None]
        return min(ages) if ages else None

    @property
    def pids(self) -> tuple[int, ...]:
        return tuple(sorted({p.pid for p in self.processes}))


@dataclass(frozen=True)
class GpuRow:
    index: int
    name: str
    total: int | None          # NVML total, or None without NVML
    used: int | None           # NVML used (all processes, also those convgpu cannot see)
    tracked: int               # live + context overhead of the processes convgpu traces


@dataclass(frozen=True)
class Snapshot:
    ts: float                  # wall clock (time.time())
    mode: str                  # "driver", "demo" (stand-in driver) or "waiting" (no driver yet)
    gpus: tuple[GpuRow, ...]
    containers: tuple[ContainerRow, ...]
    events: tuple = ()         # recent probes.events.Event, newest last
    events_total: int = 0
    drops: int = 0
    libraries: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    enforce: dict | None = None   # `convgpu status --json` of the enforcer this came from

    def to_json(self) -> dict:
        d = {
            "type": "snapshot", "schema": SNAPSHOT_SCHEMA, "ts": self.ts, "mode": self.mode,
            "gpus": [asdict(g) for g in self.gpus],
            "containers": [],
            "events_total": self.events_total, "drops": self.drops,
            "libraries": list(self.libraries), "notes": list(self.notes),
        }
        for c in self.containers:
            row = {k: v for k, v in asdict(c).items() if k != "processes"}
            row.update(live=c.live, overhead=c.overhead, total=c.total, rate=c.rate,
                       last_event_age=c.last_event_age,
                       processes=[dict(asdict(p), total=p.total) for p in c.processes])
            d["containers"].append(row)
        if self.enforce is not None:
            d["enforce"] = self.enforce
        return d

    @classmethod
    def from_json(cls, d: dict, events=()) -> "Snapshot":
        """The inverse of to_json: `convgpu trace` shows what a running enforcer sends."""
        containers = []
        for c in d["containers"]:
            procs = tuple(ProcessRow(**{k: v for k, v in p.items() if k != "total"}) for p in c["processes"])
            containers.append(ContainerRow(c["id"], c["name"], c["kind"], c["cgroup"], procs, c["peak"],
                                           c.get("labels") or {}))
        return cls(d["ts"], d["mode"], tuple(GpuRow(**g) for g in d["gpus"]), tuple(containers),
                   tuple(events), d["events_total"], d["drops"], tuple(d["libraries"]),
                   tuple(d["notes"]), d.get("enforce"))
