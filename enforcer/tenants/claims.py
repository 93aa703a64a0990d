"""DRA claims as the enforcer keeps them (issue 40): what the DRA kubelet plugin (kube/dra.py)
prepared for a ResourceClaim, and the limit a container gets from the claims of its pod.

A claim's entry says which pods it is reserved for (pod uids, from the claim's
status.reservedFor), what it holds on each GPU (its results' consumedCapacity.memory, keyed by
the GPU's uuid or "gpu<index>", as the enforcer names GPUs) and, once the agent has matched them
through the kubelet's pod-resources API, which containers use it (their ids). The entry is kept
in the state dir (tenants/durable.py) before Prepare answers, so a container is limited from
its first CUDA call, through a kill -9 of the plugin or of the enforcer.

The limit of a container of such a pod, on each GPU (claim_limit):
- once matched, the sum of the claims it uses (several claims on one GPU are each its own share,
  and a container that uses two of them holds both);
- before that (its id is not known to the agent yet: the first seconds, a restarted container),
  the smallest share any of its pod's claims has on that GPU, as the device plugin's pod entry
  carries the smallest grant: no container gets more than a claim of its pod holds there.
A container that does not use a claim does not see its GPU (the claim's CDI devices go only to
the containers that name it), so the bound above is moot for it.

Pure: no file, no socket (tests/unit/test_dra_claims.py)."""
from dataclasses import dataclass

from ...errors import ConvgpuError
from .limits import PodLimit

MAX_PODS = 256          # ResourceClaim.status.reservedFor holds at most 256 consumers
MAX_GPUS = 32           # an allocation holds at most 32 results
MAX_CONTAINERS = 1024   # a pod's containers, restarts included, many times over
MAX_ID = 128            # a claim or pod uid (36), a container id (64), with room
MAX_REF = 400           # "namespace/name": 63 + 1 + 253
FIX = ('send {"claim": "ns/name", "pods": [uid], "gpus": {gpu: bytes}, "containers": [id]} '
       "(kube/dra.py)")


@dataclass(frozen=True)
class ClaimShare:
    ref: str                  # "namespace/name", for logs and status
    pods: tuple = ()          # pod uids the claim is reserved for
    gpus: tuple = ()          # ((gpu key, bytes), ...), sorted
    containers: tuple = ()    # ids of the containers known to use it, sorted

    def wire(self) -> dict:
        return {"claim": self.ref, "pods": list(self.pods), "gpus": dict(self.gpus),
                "containers": list(self.containers)}

    @property
    def bytes(self) -> int:
        return sum(b for _, b in self.gpus)


def _ident(s) -> bool:
    return isinstance(s, str) and 0 < len(s) <= MAX_ID and s.isprintable() and "/" not in s


def _size(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def parse(uid, raw) -> ClaimShare:
    """One claim's entry from the wire (the control socket, the decisions file); ConvgpuError
    naming the claim otherwise."""
    def bad(why):
        return ConvgpuError(f"invalid claim {str(uid)[:80]!r}: {why}", FIX)
    if not _ident(uid):
        raise bad("its uid")
    if not isinstance(raw, dict):
        raise bad("not a table")
    ref, pods, gpus, cids = raw.get("claim"), raw.get("pods"), raw.get("gpus"), raw.get("containers", [])
    if not (isinstance(ref, str) and 0 < len(ref) <= MAX_REF and ref.isprintable()):
        raise bad("its name")
    if not (isinstance(pods, list) and 0 < len(pods) <= MAX_PODS and all(_ident(p) for p in pods)):
        raise bad(f"pods must be 1 to {MAX_PODS} pod uids")
    if not (isinstance(gpus, dict) and 0 < len(gpus) <= MAX_GPUS
            and all(_ident(k) and _size(b) for k, b in gpus.items())):
        raise bad(f"gpus must be 1 to {MAX_GPUS} GPUs, each with a size above 0")
    if not (isinstance(cids, list) and len(cids) <= MAX_CONTAINERS and all(_ident(c) for c in cids)):
        raise bad(f"containers must be at most {MAX_CONTAINERS} container ids")
    return ClaimShare(ref, tuple(sorted(set(pods))), tuple(sorted(gpus.items())), tuple(sorted(set(cids))))


def parse_all(raw) -> dict:
    if not isinstance(raw, dict):
        raise ConvgpuError(f"invalid claims {str(raw)[:200]!r}", FIX)
    return {uid: parse(uid, v) for uid, v in raw.items()}


def on_gpu(claims: dict, key: str) -> int:
    """Bytes the claims hold on one GPU (by key)."""
    return sum(dict(c.gpus).get(key, 0) for c in claims.values())


def claim_limit(claims: dict, cid: str, pod: str | None) -> PodLimit | None:
    """The container's limit from its pod's claims (the rules above), None if its pod has none."""
    if not pod or not claims:
        return None
    mine = [(uid, c) for uid, c in sorted(claims.items()) if pod in c.pods]
    if not mine:
        return None
    used = [(uid, c) for uid, c in mine if cid and cid in c.containers]
    split: dict[str, int] = {}
    if used:
        for _, c in used:
            for k, b in c.gpus:
                split[k] = split.get(k, 0) + b
        what = " + ".join(c.ref for _, c in used)
    else:   # not matched yet: the smallest share on each GPU
        for _, c in mine:
            for k, b in c.gpus:
                split[k] = min(split.get(k, b), b)
        what = (mine[0][1].ref if len(mine) == 1 else
                f"the smallest of {len(mine)} claims of its pod ({', '.join(c.ref for _, c in mine)})")
    return PodLimit(sum(split.values()), f"DRA claim {what}", False, tuple(sorted(split.items())))
