"""What a job should ask for, from its recent runs: pure functions over the history (store.py).
The method, and its limits, are in docs/RECOMMEND.md; in short:

1. the window: the job's newest `runs` runs (all it has, up to MAX_RUNS);
2. each run's peak: the most it held on any one GPU, its allocations and its context charge
   together (a limit applies on each GPU and counts both);
3. the peak of the window: the `percentile`-th of the runs' peaks, by nearest rank (100, the
   default: the largest);
4. the limit: that peak plus the margin (`margin_pct` percent of it, rounded up to a byte, and
   `margin_bytes`), rounded up to a whole `unit` (at least one unit);
5. covers: how many runs of the window had a peak at or below that limit.

Flags: over-asking, where what it asks today (its newest run's limit) is at least `over` times
the recommendation and one unit more; under-asking, where a run of the window was refused a
call above its limit, waited with its whole limit assigned (it waited on itself, not on the
card), or stalled with a peak whose own recommendation is above what it asked. A job held at
its limit never showed what it needs beyond it: its recommendation is then a floor."""
import math
from dataclasses import asdict, dataclass

from .store import MAX_RUNS, History, Run

MiB, GiB = 1 << 20, 1 << 30
UNIT = 256 << 20        # kube/devices.py UNIT: the device plugin's default unit
DEVICE_CLASS = "gpu-memory.convgpu.io"
RESOURCE = "convgpu.io/gpu-memory"


@dataclass(frozen=True)
class Method:
    margin_pct: int = 10
    margin_bytes: int = 0
    unit: int = UNIT
    runs: int = MAX_RUNS
    percentile: float = 100.0
    over: float = 2.0
    few: int = 3             # fewer runs than this: said ("few runs")

    def text(self) -> str:
        margin = " + ".join(x for x in (f"{self.margin_pct} %" if self.margin_pct else "",
                                        size_text(self.margin_bytes) if self.margin_bytes else "") if x) or "no margin"
        pick = "the largest peak" if self.percentile >= 100 else f"the p{self.percentile:g} peak"
        return (f"{pick} of the newest {self.runs} runs + {margin}, rounded up to {size_text(self.unit)}")


@dataclass(frozen=True)
class Recommendation:
    job: str
    runs: int                 # in the window
    peak: int                 # the window's peak (its percentile)
    peaks: dict               # gpu -> the largest peak there in the window
    limit: int                # recommended
    covers: int               # runs of the window whose peak is at or below it
    asked: int | None         # what it asks today (its newest run's limit)
    source: str
    units: int                # limit / unit
    gpus: int                 # GPUs its newest run used
    stalls: int
    stalled_s: float
    at_limit_s: float
    over_limits: int
    over_asking: bool
    under_asking: bool
    notes: tuple

    def to_json(self, method: Method) -> dict:
        d = asdict(self)
        d["peaks"] = {str(k): v for k, v in self.peaks.items()}
        d["notes"] = list(self.notes)
        d["forms"] = forms(self, method)
        return d


def round_up(n: int, unit: int) -> int:
    return max(1, -(-n // unit)) * unit


def with_margin(peak: int, m: Method) -> int:
    return round_up(peak + -(-peak * m.margin_pct // 100) + m.margin_bytes, m.unit)


def nearest_rank(values: list[int], percentile: float) -> int:
    """The percentile by nearest rank: the smallest value with at least p % of them at or below."""
    ordered = sorted(values)
    rank = max(1, math.ceil(round(percentile * len(ordered) / 100, 9)))
    return ordered[min(rank, len(ordered)) - 1]


def recommend(job: str, runs: tuple[Run, ...], m: Method = Method()) -> Recommendation | None:
    window = list(runs)[-m.runs:]
    if not window:
        return None
    peak = nearest_rank([r.peak for r in window], m.percentile)
    limit = with_margin(peak, m)
    peaks: dict = {}
    for r in window:
        for d, g in r.gpus.items():
            peaks[d] = max(peaks.get(d, 0), g.peak)
    newest = window[-1]
    asked = newest.limit
    over = asked is not None and asked >= m.over * limit and asked - limit >= m.unit
    waited_self = [r for r in window if r.over_limits or r.at_limit_s > 0
                   or (r.stalls and r.limit is not None and with_margin(r.peak, m) > r.limit)]
    notes = []
    if len(window) < m.few:
        notes.append(f"few runs ({len(window)}): a first run says less than ten")
    if waited_self:
        notes.append(f"held at its limit in {len(waited_self)} of {len(window)} runs: it may need more than it "
                     "showed; the limit is a floor")
    if any(r.end == "stopped" for r in window):
        notes.append("runs cut short by a stop of the recorder are counted as far as they went")
    if over:
        notes.append(f"asks {size_text(asked)}, {asked / limit:.1f} x what it needs")
    return Recommendation(job, len(window), peak, dict(sorted(peaks.items())), limit,
                          sum(1 for r in window if r.peak <= limit), asked, newest.source, limit // m.unit,
                          len(newest.gpus), sum(r.stalls for r in window), round(sum(r.stalled_s for r in window), 3),
                          round(sum(r.at_limit_s for r in window), 3), sum(r.over_limits for r in window),
                          over, bool(waited_self), tuple(notes))


def summarize(h: History, m: Method = Method()) -> tuple:
    return tuple(r for k in sorted(h.jobs) if (r := recommend(k, h.jobs[k], m)) is not None)


# ---- forms to paste ----

def size_text(n: int | None) -> str:
    """Exact, in the largest binary unit that divides it: 2560MiB, 3GiB (parse_size reads it back)."""
    if n is None:
        return "-"
    for unit, name in ((GiB, "GiB"), (MiB, "MiB"), (1 << 10, "KiB")):
        if n and n % unit == 0:
            return f"{n // unit}{name}"
    return f"{n}B"


def quantity(n: int) -> str:
    """A Kubernetes quantity, exact: 2560Mi, 3Gi."""
    return size_text(n).replace("iB", "i")


def dns_name(job: str) -> str:
    """A DNS-1123 name from a job key, for the claim template's metadata.name."""
    out = "".join(c if c.isalnum() and c.isascii() else "-" for c in job.split(":", 1)[-1].lower())
    out = "-".join(p for p in out.split("-") if p)[:40].strip("-")
    return f"{out or 'job'}-gpu-memory"


def forms(r: Recommendation, m: Method) -> dict:
    """The recommendation in the forms each way of asking takes: `convgpu run --limit`, the
    device plugin's units (`convgpu kube --unit` of m.unit), a DRA ResourceClaimTemplate."""
    name = r.job.split(":", 1)[1] if r.job.startswith("run:") else "NAME"
    units = (f"resources:\n  limits:\n    {RESOURCE}: {r.units}   # x {size_text(m.unit)} "
             f"(convgpu kube --unit {size_text(m.unit)})")
    dra = (f"apiVersion: resource.k8s.io/v1\nkind: ResourceClaimTemplate\nmetadata:\n  name: {dns_name(r.job)}\n"
           f"spec:\n  spec:\n    devices:\n      requests:\n      - name: gpu-memory\n        exactly:\n"
           f"          deviceClassName: {DEVICE_CLASS}\n          capacity:\n            requests:\n"
           f"              memory: {quantity(r.limit)}")
    return {"run": f"convgpu run --limit {size_text(r.limit)} --name {name} -- COMMAND", "units": units, "dra": dra}
