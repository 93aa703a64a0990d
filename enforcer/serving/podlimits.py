"""The `pod-limits` control command: the Kubernetes agent's whole set of limits (kube/pods.py),
keyed by container id or pod uid. It replaces the previous set, and every running container's
limit is worked out again, as a reload does: a pod's new or removed grant takes effect at once
(a waiter that now fits resumes), while `convgpu limit set` and --limit still win."""
import logging

from ...errors import ConvgpuError

log = logging.getLogger(__name__)


def parse(raw) -> dict[str, tuple[int, str]]:
    if not isinstance(raw, dict):
        raise ConvgpuError(f"invalid pod limits {raw!r}", "send {key: [bytes, source]}")
    out = {}
    for key, v in raw.items():
        if not (isinstance(key, str) and key and isinstance(v, (list, tuple)) and len(v) == 2
                and isinstance(v[0], int) and not isinstance(v[0], bool) and v[0] > 0 and isinstance(v[1], str)):
            raise ConvgpuError(f"invalid pod limit {key!r}: {v!r}", "send {key: [bytes, source]}")
        out[key] = (v[0], v[1])
    return out


def apply(enf, raw) -> dict:
    limits = parse(raw)
    enf.rules.pods = limits
    changed = 0
    for box in list(enf.boxes.values()):
        limit, source = enf.rules.limit_for(box.container, box.name, box.labels)
        capped = enf._capped(box.name, limit)
        if (capped, source) != (box.limit, box.source):
            enf._apply_limit(box, capped, source)
            changed += 1
    log.info("pod limits: %d keys, %d running container(s) changed", len(limits), changed)
    return {"keys": len(limits), "changed": changed}
