"""Which limit a container gets, first that applies: `convgpu limit set` at run time, the
`convgpu run --limit` its cgroup was registered with, --limit NAME_OR_ID=SIZE, the pod's own units
(Kubernetes agent, kube/pods.py) or the budget of the DRA claims that bind it (tenants/claims.py:
one budget shared by every container that uses a claim), the first matching
[[rule]] of the config file, the label com.nvidia.memory.limit (as in the ConVGPU paper),
--default-limit. An operator's rule beats a label because whoever starts a container chooses
its labels. The pod's annotation convgpu.io/gpu-memory-limit comes last and only lowers: the
container gets the smaller of it and what the steps above give (its units, else the rules),
because the pod's author writes it (docs/SECURITY.md, row 10). A bad label never stops the
daemon: the container gets the default and a warning. The run-time sources (limit set, convgpu
run, the pod's) are kept across restarts (enforcer/tenants/durable.py); where they could not be
read at start, every limit is `unknown` (0: nothing more is admitted until they are read)."""
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import NamedTuple

from ...errors import SizeError
from ...units import format_size, parse_size
from .config import Rule
from .containers import Container

log = logging.getLogger(__name__)
LABEL = "com.nvidia.memory.limit"
DEFAULT_LIMIT = 1 << 30   # the paper's default
SEEN = 4096               # containers remembered for unmatched(): the most recently seen
UNKNOWN = "unknown"       # the source of every limit while the run-time decisions cannot be read


def unknown(source: str) -> bool:
    return source.startswith(UNKNOWN)


class PodLimit(NamedTuple):
    """What the Kubernetes agent says of a container (by id) or a pod (by uid)."""
    bytes: int
    source: str
    # the pod's annotation (or nothing, bytes 0): bounds what the operator's steps give, never
    # raises it; False: the pod's units, which the scheduler counted (they beat rules)
    lower_only: bool = False
    gpus: tuple = ()      # ((host GPU uuid or "gpu<index>", bytes), ...): the grant on each GPU
    job: str = ""         # namespace/Kind/owner/container: the job its runs are kept under (enforcer/history/)
    named_only: bool = False   # a DRA claim's budget: 0 on a GPU `gpus` does not name (issue 48)

    def wire(self) -> list:
        return [self.bytes, self.source, {"lower_only": self.lower_only, "gpus": dict(self.gpus)}
                | ({"job": self.job} if self.job else {})]


def parse_limit_args(items: list[str]) -> dict[str, int]:
    """["trainer=4GiB", ...] -> {"trainer": 4294967296}; errors name the value and the fix."""
    out = {}
    for item in items:
        name, sep, size = item.partition("=")
        if not sep or not name.strip():
            raise SizeError(f"invalid --limit {item!r}", "write NAME_OR_ID=SIZE, e.g. --limit trainer=4GiB")
        out[name.strip()] = parse_size(size, f"--limit {name.strip()}")
    return out


@dataclass
class LimitRules:
    explicit: dict[str, int] = field(default_factory=dict)
    default: int = DEFAULT_LIMIT
    rules: list[Rule] = field(default_factory=list)
    runtime: dict[str, int] = field(default_factory=dict)   # container id -> `limit set`
    runs: dict[str, int] = field(default_factory=dict)      # cgroup -> `convgpu run --limit`
    # why the run-time decisions could not be read ("": they could): every limit is unknown
    unreadable: str = ""
    # container id or pod uid -> PodLimit, from the Kubernetes agent (`pod-limits`)
    pods: dict[str, PodLimit] = field(default_factory=dict)
    # claim uid -> ClaimShare, from the DRA kubelet plugin (tenants/claims.py): a container of a
    # pod with claims gets its limit from them, in place of the pod-limits entry
    claims: dict = field(default_factory=dict)
    # container id -> (Container, name, labels) of every container a limit was worked out for
    # (the newest SEEN): what unmatched() looks at; a reload keeps it (take_config)
    seen: OrderedDict = field(default_factory=OrderedDict, repr=False, compare=False)

    def take_config(self, other: "LimitRules"):
        """A reload: the config file's part (--limit, the default, the rules) from `other`, in
        place (the parts hold this object); the run-time part is the durable decisions'."""
        self.explicit, self.default, self.rules = other.explicit, other.default, other.rules

    def binding(self, c: Container) -> tuple:
        """The uids of the DRA claims that bind the container (tenants/claims.py)."""
        from .claims import binding   # claims.py builds PodLimits: imported late
        return binding(self.claims, c.id, c.pod)

    def budget(self, uids) -> PodLimit | None:
        """The limit of a budget that holds these claims (None: it holds none that is prepared)."""
        from .claims import budget_limit
        return budget_limit(self.claims, uids) if uids else None

    def pod_limit(self, c: Container, budget: PodLimit | None = None) -> PodLimit | None:
        """What the Kubernetes agents say of a container: the budget of the claims it is charged
        to (given by the books, which know which budget holds which claim), else the claims that
        bind it, else its pod limit entry."""
        if budget is not None:
            return budget
        if self.claims:
            got = self.budget(self.binding(c))
            if got is not None:
                return got
        for key in (c.id, c.pod):   # the container's own entry, else its pod's (id not known yet)
            if key and key in self.pods:
                p = self.pods[key]
                return p if isinstance(p, PodLimit) else PodLimit(*p)   # (bytes, source) as before
        return None

    def shares_for(self, c: Container, budget: PodLimit | None = None) -> dict[str, int]:
        """{host GPU key: bytes}: where the pod's grant lies, each GPU's share of it (a grant
        that spans GPUs is limited on each to its share, not to the total on every one)."""
        p = self.pod_limit(c, budget)
        return dict(p.gpus) if p is not None and not p.lower_only else {}

    def share(self, c: Container, gpu: str, limit: int, source: str, budget: PodLimit | None = None) -> int:
        """The container's limit on one GPU (gpu: its uuid, else "gpu<index>"): its pod's share
        there while the limit is the pod's grant (`source` is its source); else `limit`. A GPU
        the device plugin's grant does not name (an ordinal not mapped to a host GPU yet) keeps
        `limit`; one a DRA claim does not name gets 0 (issue 48: the scheduler counted the claim
        on its own GPUs only)."""
        p = self.pod_limit(c, budget)
        if p is None or p.lower_only or p.source != source:
            return limit
        return min(limit, dict(p.gpus).get(gpu, 0 if p.named_only else limit))

    def limit_for(self, c: Container, name: str | None, labels: dict | None,
                  budget: PodLimit | None = None) -> tuple[int, str]:
        """(bytes, where it came from) for a container."""
        self.seen[c.id] = (c, name, labels)
        self.seen.move_to_end(c.id)
        while len(self.seen) > SEEN:
            self.seen.popitem(last=False)
        if self.unreadable:   # any container may have had a decision that is lost: hold (fail closed)
            return 0, f"{UNKNOWN}: the run-time decisions could not be read ({self.unreadable})"
        pod = self.pod_limit(c, budget)
        limit, source = self._operator(c, name, labels, pod)
        if pod is not None and pod.lower_only and 0 < pod.bytes < limit:
            return pod.bytes, f"{pod.source} (under {format_size(limit)}: {source})"
        return limit, source

    def _operator(self, c: Container, name, labels, pod: PodLimit | None) -> tuple[int, str]:
        if c.id in self.runtime:
            return self.runtime[c.id], "convgpu limit set"
        if c.cgroup in self.runs:
            return self.runs[c.cgroup], "convgpu run --limit"
        for key in (name, c.id, c.short, c.unit, c.cgroup):
            if key and key in self.explicit:
                return self.explicit[key], f"--limit {key}"
        for key, size in self.explicit.items():
            if len(key) >= 6 and c.id.startswith(key):
                return size, f"--limit {key}"
        if pod is not None and not pod.lower_only:   # the pod's units: beat rules and labels
            return pod.bytes, pod.source
        for rule in self.rules:
            if rule.matches(c, name, labels):
                return rule.limit, rule.source
        raw = (labels or {}).get(LABEL)
        if raw is not None:
            try:
                return parse_size(raw, f"label {LABEL}", bare=True), f"label {LABEL}"
            except SizeError as e:
                log.warning("container %s: %s; using the default limit %s", name or c.short, e,
                            format_size(self.default))
        return self.default, "default"

    def unmatched(self) -> list[str]:
        """The --limit keys and [[rule]]s that match no container seen so far (whether another
        source won for it or not): a name written otherwise than convgpu sees it gives its
        container the default with nothing said, so the enforcer says these at start and at
        each reload."""
        seen = list(self.seen.values())

        def explicit(key: str) -> bool:
            return any(key in (name, c.id, c.short, c.unit, c.cgroup) or (len(key) >= 6 and c.id.startswith(key))
                       for c, name, _ in seen)
        return ([f"--limit {k}" for k in self.explicit if not explicit(k)]
                + [r.source for r in self.rules if not any(r.matches(c, name, labels) for c, name, labels in seen)])
