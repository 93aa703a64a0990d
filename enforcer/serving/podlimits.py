"""The `pod-limits` control command: the Kubernetes agent's whole set of limits (kube/pods.py),
keyed by container id or pod uid, each [bytes, source] or [bytes, source, {"lower_only": bool,
"gpus": {host GPU key: bytes}, "job": namespace/Kind/owner/container}] (enforcer/tenants/limits.py
PodLimit; the job names its runs in the job history). It replaces the previous set, and every
running container's limit is worked out again, as a reload does: a pod's new or removed grant
takes effect at once (a waiter that now fits resumes), while `convgpu limit set` and --limit
still win. The set is kept in the state dir (enforcer/tenants/durable.py) before it applies: one that cannot be
written is refused, and the previous set stays in force (the agent sends it again next round)."""
import logging

from ...errors import ConvgpuError
from ..tenants.limits import PodLimit

log = logging.getLogger(__name__)


FIX = 'send {key: [bytes, source]} or [bytes, source, {"lower_only": bool, "gpus": {gpu: bytes}, "job": str}]'
MAX_JOB = 600   # characters of a job: namespace (63) / kind / owner (253) / container (63)


def _size(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def parse(raw) -> dict[str, PodLimit]:
    if not isinstance(raw, dict):
        raise ConvgpuError(f"invalid pod limits {str(raw)[:200]!r}", FIX)
    out = {}
    for key, v in raw.items():
        opts = v[2] if isinstance(v, (list, tuple)) and len(v) == 3 else {}
        gpus = opts.get("gpus", {}) if isinstance(opts, dict) else None
        lower = opts.get("lower_only", False) if isinstance(opts, dict) else None
        job = opts.get("job", "") if isinstance(opts, dict) else None
        if not (isinstance(key, str) and key and isinstance(v, (list, tuple)) and len(v) in (2, 3)
                and _size(v[0]) and isinstance(v[1], str) and isinstance(lower, bool)
                and (v[0] > 0 or lower) and isinstance(gpus, dict) and isinstance(job, str) and len(job) <= MAX_JOB
                and all(isinstance(k, str) and k and _size(b) for k, b in gpus.items())):
            raise ConvgpuError(f"invalid pod limit {str(key)[:100]!r}: {str(v)[:200]!r}", FIX)
        out[key] = PodLimit(v[0], v[1], lower, tuple(sorted(gpus.items())), job)
    return out


def apply(rt, raw) -> dict:
    """rt: the enforcer's Runtime (enforcer/runtime.py)."""
    limits = parse(raw)
    claimed = {k for c in rt.durable.value.claims.values() for k, _ in c.gpus}
    both = sorted({k for p in limits.values() if not p.lower_only for k, _ in p.gpus} & claimed)
    if both:   # kube/owner.py keeps the two agents apart; this is the enforcer's own check
        raise ConvgpuError(f"pod limits refused: GPU {', '.join(both)} holds DRA claims (kube/dra.py)",
                           "a node runs the device plugin or DRA on a GPU, never both: see docs/KUBERNETES.md")
    rt.durable.commit(rt.durable.value.with_pods(limits), "the pod limits")
    changed = relimit(rt)
    log.info("pod limits: %d keys, %d running container(s) changed", len(limits), changed)
    rt.warn_small_pods()
    return {"keys": len(limits), "changed": changed}


def relimit(rt) -> int:
    """The decisions just committed into the rules, and every running container's limit worked
    out again (a waiter that now fits resumes). Returns how many changed."""
    rt.decided()
    return rt.relimit()
