"""The run-time decisions as one value (Decisions: `convgpu run`'s registrations, `convgpu
limit set`, the Kubernetes agent's pod limits, the DRA plugin's claims) and the format of the
file that keeps them (encode, decode: a format name, a version with MIGRATIONS, a checksum).
Pure: no file is touched here; tenants/durable.py (Store) writes and reads it."""
import json
import time
from dataclasses import dataclass, field, replace

from ...errors import ConvgpuError
from .statefile import Unreadable, checked_body, digest

FILE = "decisions.json"
FORMAT = "convgpu-decisions"
VERSION = 2             # 2: "claims" (issue 40)
MAX_ENTRIES = 4096       # of each kind: a node's containers with a decision, many times over
MAX_TEXT = 1024          # characters of a name, an id or a source
MAX_PATH = 4096          # characters of a cgroup path (PATH_MAX)
MAX_BYTES = 16 << 20     # a larger file is not ours (MAX_ENTRIES of each kind take ~3 MiB)
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
