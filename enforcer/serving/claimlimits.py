"""The DRA plugin's control commands (kube/dra.py; the claims themselves: tenants/claims.py):

  claim-prepare    {"claims": {U: {...}}, "deadline": T}  the claims of one Prepare, decided
                   together and kept (one write) before the reply: {"claims": {U: {"changed": B}
                   or {"error": LINE}}}; {"uid": U, "claim": {...}}: one claim (its error raised)
  claim-unprepare  {"uids": [U]} or {"uid": U}             their entries gone (one write)
  claim-containers {"containers": {U: {"containers": [id], "users": [pod uid]}}}  which containers
                   and pods the agent saw using which prepared claims (a list: the containers only)

Each is idempotent (a repeat changes nothing and writes nothing), and one claim's refusal leaves
every other decision as it was. Prepare refuses a claim that would put a GPU's claims past the
GPU's capacity as the enforcer counts it, a share below one CUDA context's charge there (its
pod's first call would wait for good: issue 52), a GPU the enforcer does not know, and a GPU
whose memory the device plugin's pod limits share out (a node runs one or the other on a GPU:
kube/owner.py keeps the agents apart, this keeps the books apart).

The deadline (CLOCK_MONOTONIC, which every process of the host shares) is when the plugin stops
waiting for the reply and tells the kubelet that the claims failed. A request read after it
keeps nothing (issue 48: an enforcer held up for seconds committed claims the kubelet had been
told had failed, and their memory stayed counted for pods that would never run)."""
import logging
import time

from ...errors import ConvgpuError
from ...units import format_size
from ..ctxest import below_context_text
from ..tenants.claims import on_gpu, parse
from .podlimits import relimit

log = logging.getLogger(__name__)
MAX_BATCH = 4096   # claims in one request (kube/dra.py MAX_CLAIMS)


def _gpus(rt) -> dict[str, int]:
    """{GPU key: capacity} as the enforcer counts its GPUs (rt: its Runtime, enforcer/runtime.py)."""
    return {rt.gpu_key(d): c for d, c in rt.books.capacity.items()}


def prepare(rt, uid, raw) -> dict:
    """One claim (the single form): its answer, or its error raised."""
    got = prepare_all(rt, {uid: raw} if isinstance(uid, str) else {str(uid): raw})["claims"]
    answer = next(iter(got.values()))
    if "error" in answer:
        raise ConvgpuError(answer["error"])
    return answer


def prepare_all(rt, raw, deadline=None) -> dict:
    """The claims of one Prepare, each checked against the GPUs' capacity with those before it
    in the request, and every one that fits kept in one write before the reply."""
    if not (isinstance(raw, dict) and 0 < len(raw) <= MAX_BATCH):
        raise ConvgpuError(f"invalid claims: 1 to {MAX_BATCH} are prepared at once", 'send {"claims": {uid: {...}}}')
    if deadline is not None and (isinstance(deadline, bool) or not isinstance(deadline, (int, float))):
        raise ConvgpuError(f"invalid deadline {str(deadline)[:40]!r}", "send the plugin's time.monotonic() bound")
    late = deadline is not None and time.monotonic() > deadline
    held = dict(rt.durable.value.claims)
    gpus = _gpus(rt)
    plugin = {k for p in rt.rules.pods.values() if not p.lower_only for k, _ in p.gpus}
    totals = {k: on_gpu(held, k) for k in gpus}
    out: dict[str, dict] = {}
    new = []
    for uid, wire in raw.items():
        try:
            if late:
                raise ConvgpuError(f"the DRA plugin stopped waiting {time.monotonic() - deadline:.1f} s before the "
                                   "enforcer read this request: nothing kept", "the kubelet asks again")
            claim = parse(uid, wire)
            old = held.get(uid)
            if old is not None:   # matched already: its containers and users are kept
                claim = type(claim)(claim.ref, claim.pods, claim.gpus, old.containers, old.users)
            if old == claim:
                out[uid] = {"changed": False}
                continue
            _fits(rt, claim, old, gpus, plugin, totals)
            for key, size in old.gpus if old else ():
                totals[key] = totals.get(key, 0) - size
            for key, size in claim.gpus:
                totals[key] += size
            held[uid] = claim
            new.append(uid)
            out[uid] = {"changed": True}
        except ConvgpuError as e:
            out[str(uid)] = {"error": str(e)}
    if new:
        try:
            rt.durable.commit(rt.durable.value.with_claims(held), f"claim{'s' if len(new) > 1 else ''} "
                              f"{', '.join(held[u].ref for u in new[:3])}{' ...' if len(new) > 3 else ''}")
        except ConvgpuError as e:
            return {"claims": {u: ({"error": str(e)} if u in new else a) for u, a in out.items()}}
        changed = relimit(rt)
        log.info("DRA claims prepared: %s; %d running budget(s) changed", "; ".join(
            f"{held[u].ref}: {', '.join(f'{format_size(b)} on {k}' for k, b in held[u].gpus)} for pods "
            f"{','.join(held[u].pods)}" for u in new[:8]) + (f"; and {len(new) - 8} more" if len(new) > 8 else ""),
            changed)
    return {"claims": out}


def _fits(rt, claim, old, gpus: dict, plugin: set, totals: dict):
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
        total = totals[key] - (dict(old.gpus).get(key, 0) if old else 0) + size   # its old entry replaced
        if total > gpus[key]:
            raise ConvgpuError(f"claim {claim.ref}: {format_size(size)} on GPU {key} would put its claims at "
                               f"{format_size(total)}, past its {format_size(gpus[key])}",
                               "the ResourceSlice's capacity is more than the enforcer's: give both the same "
                               "--reserve / --gpu-memory")


def unprepare(rt, uids) -> dict:
    """Claims' entries gone (a uid or a list of them), in one write."""
    uids = [uids] if isinstance(uids, str) else uids if isinstance(uids, list) else []
    held = rt.durable.value.claims
    gone = [u for u in dict.fromkeys(uids) if isinstance(u, str) and u in held]
    if not gone:
        return {"changed": False}
    rt.durable.commit(rt.durable.value.with_claims({k: v for k, v in held.items() if k not in gone}),
                      f"the end of claim{'s' if len(gone) > 1 else ''} {', '.join(held[u].ref for u in gone[:3])}")
    changed = relimit(rt)
    log.info("DRA claims unprepared: %s; %d running budget(s) changed", ", ".join(held[u].ref for u in gone[:8])
             + (f" and {len(gone) - 8} more" if len(gone) > 8 else ""), changed)
    return {"changed": True}


def containers(rt, raw) -> dict:
    """{uid: {"containers": [ids], "users": [pod uids]}} (or {uid: [ids]}) for prepared claims;
    uids not prepared (any more) are skipped."""
    if not isinstance(raw, dict):
        raise ConvgpuError(f"invalid claim containers {str(raw)[:200]!r}",
                           'send {"uid": {"containers": ["container id", ...], "users": ["pod uid", ...]}}')
    held = rt.durable.value.claims
    new = dict(held)
    for uid, got in raw.items():
        if uid in held:
            c = held[uid]
            seen = got if isinstance(got, dict) else {"containers": got}
            new[uid] = parse(uid, {**c.wire(), "containers": seen.get("containers", []),
                                   "users": seen.get("users", list(c.users))})
    if new == held:
        return {"changed": False}
    rt.durable.commit(rt.durable.value.with_claims(new), "the containers of the DRA claims")
    changed = relimit(rt)
    log.info("DRA claims matched to containers: %s; %d running budget(s) changed",
             ", ".join(f"{new[u].ref} {len(new[u].containers)} container(s), {len(new[u].pods) + len(new[u].users)} "
                       "pod(s)" for u in sorted(new) if new[u] != held.get(u)), changed)
    return {"changed": True}
