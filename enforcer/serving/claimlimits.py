"""The DRA plugin's control commands (kube/dra.py; the claims themselves: tenants/claims.py):

  claim-prepare    {"uid": U, "claim": {...}}   the claim's entry, kept before the reply
  claim-unprepare  {"uid": U}                   its entry gone
  claim-containers {"containers": {U: [id]}}    which containers use which prepared claims

Each is idempotent (a repeat changes nothing and writes nothing) and concerns one claim, so one
claim's refusal leaves every other decision as it was. Prepare refuses a claim that would put a
GPU's claims past the GPU's capacity as the enforcer counts it, a GPU the enforcer does not
know, and a GPU whose memory the device plugin's pod limits share out (a node runs one or the
other on a GPU: kube/owner.py keeps the agents apart, this keeps the books apart)."""
import logging

from ...errors import ConvgpuError
from ...units import format_size
from ..ctxest import below_context_text
from ..tenants.claims import on_gpu, parse
from .podlimits import relimit

log = logging.getLogger(__name__)


def _gpus(rt) -> dict[str, int]:
    """{GPU key: capacity} as the enforcer counts its GPUs (rt: its Runtime, enforcer/runtime.py)."""
    return {rt.gpu_key(d): c for d, c in rt.books.capacity.items()}


def prepare(rt, uid, raw) -> dict:
    claim = parse(uid, raw)
    held = rt.durable.value.claims
    old = held.get(uid)
    if old is not None and not claim.containers:
        claim = type(claim)(claim.ref, claim.pods, claim.gpus, old.containers)   # matched already: kept
    if old == claim:
        return {"changed": False}
    gpus = _gpus(rt)
    others = {k: v for k, v in held.items() if k != uid}
    plugin = {k for p in rt.rules.pods.values() if not p.lower_only for k, _ in p.gpus}
    for key, size in claim.gpus:
        if key not in gpus:
            raise ConvgpuError(f"claim {claim.ref}: GPU {key} is not one of the enforcer's GPUs "
                               f"({', '.join(sorted(gpus)) or 'none'})", "see `convgpu status`; the GPU may be lost")
        if key in plugin:
            raise ConvgpuError(f"claim {claim.ref}: GPU {key} is shared out by the device plugin's pod limits",
                               "a node runs the device plugin or DRA on a GPU, never both: see docs/KUBERNETES.md")
        small = rt.context_below(size, key)
        if small:   # refused at once: else its pod's first CUDA call waits for good (issue 52)
            raise ConvgpuError(below_context_text(f"claim {claim.ref}: its share", size, small),
                               "ask for the context plus what the job allocates (`convgpu status` shows the "
                               "context per GPU)")
        total = on_gpu(others, key) + size
        if total > gpus[key]:
            raise ConvgpuError(f"claim {claim.ref}: {format_size(size)} on GPU {key} would put its claims at "
                               f"{format_size(total)}, past its {format_size(gpus[key])}",
                               "the ResourceSlice's capacity is more than the enforcer's: give both the same "
                               "--reserve / --gpu-memory")
    rt.durable.commit(rt.durable.value.with_claims({**held, uid: claim}), f"claim {claim.ref}")
    changed = relimit(rt)
    log.info("DRA claim %s prepared: %s for pods %s; %d running container(s) changed", claim.ref,
             ", ".join(f"{format_size(b)} on {k}" for k, b in claim.gpus), ",".join(claim.pods), changed)
    return {"changed": True}


def unprepare(rt, uid) -> dict:
    held = rt.durable.value.claims
    if not isinstance(uid, str) or uid not in held:
        return {"changed": False}
    gone = held[uid]
    rt.durable.commit(rt.durable.value.with_claims({k: v for k, v in held.items() if k != uid}),
                       f"the end of claim {gone.ref}")
    changed = relimit(rt)
    log.info("DRA claim %s unprepared; %d running container(s) changed", gone.ref, changed)
    return {"changed": True}


def containers(rt, raw) -> dict:
    """{uid: [container ids]} for prepared claims; uids not prepared (any more) are skipped."""
    if not isinstance(raw, dict):
        raise ConvgpuError(f"invalid claim containers {str(raw)[:200]!r}", 'send {"uid": ["container id", ...]}')
    held = rt.durable.value.claims
    new = dict(held)
    for uid, cids in raw.items():
        if uid in held:
            c = held[uid]
            new[uid] = parse(uid, {**c.wire(), "containers": cids})
    if new == held:
        return {"changed": False}
    rt.durable.commit(rt.durable.value.with_claims(new), "the containers of the DRA claims")
    changed = relimit(rt)
    log.info("DRA claims matched to containers: %s; %d running container(s) changed",
             ", ".join(f"{new[u].ref} {len(new[u].containers)}" for u in sorted(new) if new[u] != held.get(u)), changed)
    return {"changed": True}
