"""DRA claims as the enforcer keeps them (issues 40, 48): what the DRA kubelet plugin (kube/dra.py)
prepared for a ResourceClaim, which containers it binds, and the budget they share.

A claim's entry says which pods it is reserved for (pod uids, from the claim's
status.reservedFor at Prepare), which other pods the agent saw using it since (`users`: the
kubelet prepares a claim once, so a second pod that shares it is known only from the kubelet's
pod-resources API, kube/drasync.py), what it holds on each GPU (its results'
consumedCapacity.memory, keyed by the GPU's uuid or "gpu<index>", as the enforcer names GPUs)
and, once the agent has matched them, which containers use it (their ids). The entry is kept in
the state dir (tenants/durable.py) before Prepare answers, so a container is limited from its
first CUDA call, through a kill -9 of the plugin or of the enforcer.

A claim's consumedCapacity on a GPU is one budget, as the scheduler counted it: every process of
every container and pod that uses the claim is charged to it together (one Box in the books,
one key in BPF's maps: enforcer/runtime.py `Runtime.budget`). The claims that bind a container
(binding): once matched, the claims it uses; before that (its id is not known to the agent yet:
the first seconds, a restarted container), every claim of its pod, so it is charged inside them
from its first call. A budget holds the claims its containers bind that no other budget holds,
and its limit on each GPU is their sum there (budget_limit): 0 on a GPU none of them names. A
container that does not use a claim does not see its GPU (the claim's CDI devices go only to
the containers that name it).

Pure: no file, no socket (tests/unit/test_claims.py)."""
from dataclasses import dataclass

from ...errors import ConvgpuError
from .limits import PodLimit

MAX_PODS = 256          # ResourceClaim.status.reservedFor holds at most 256 consumers
MAX_GPUS = 32           # an allocation holds at most 32 results
MAX_CONTAINERS = 1024   # a pod's containers, restarts included, many times over
MAX_ID = 128            # a claim or pod uid (36), a container id (64), with room
MAX_REF = 400           # "namespace/name": 63 + 1 + 253
FIX = ('send {"claim": "ns/name", "pods": [uid], "gpus": {gpu: bytes}, "containers": [id], "users": [uid]} '
       "(kube/dra.py)")
SOURCE = "DRA claim"    # the start of a budget's limit source


@dataclass(frozen=True)
class ClaimShare:
    ref: str                  # "namespace/name", for logs and status
    pods: tuple = ()          # pod uids the claim is reserved for
    gpus: tuple = ()          # ((gpu key, bytes), ...), sorted
    containers: tuple = ()    # ids of the containers known to use it, sorted
    users: tuple = ()         # uids of pods the agent saw using it (beyond `pods`), sorted

    def wire(self) -> dict:
        return {"claim": self.ref, "pods": list(self.pods), "gpus": dict(self.gpus),
                "containers": list(self.containers)} | ({"users": list(self.users)} if self.users else {})

    def binds(self, cid: str | None, pod: str | None) -> bool:
        return bool(cid and cid in self.containers) or bool(pod and (pod in self.pods or pod in self.users))

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
    users = raw.get("users", [])
    if not (isinstance(ref, str) and 0 < len(ref) <= MAX_REF and ref.isprintable()):
        raise bad("its name")
    if not (isinstance(pods, list) and 0 < len(pods) <= MAX_PODS and all(_ident(p) for p in pods)):
        raise bad(f"pods must be 1 to {MAX_PODS} pod uids")
    if not (isinstance(gpus, dict) and 0 < len(gpus) <= MAX_GPUS
            and all(_ident(k) and _size(b) for k, b in gpus.items())):
        raise bad(f"gpus must be 1 to {MAX_GPUS} GPUs, each with a size above 0")
    if not (isinstance(cids, list) and len(cids) <= MAX_CONTAINERS and all(_ident(c) for c in cids)):
        raise bad(f"containers must be at most {MAX_CONTAINERS} container ids")
    if not (isinstance(users, list) and len(users) <= MAX_PODS and all(_ident(p) for p in users)):
        raise bad(f"users must be at most {MAX_PODS} pod uids")
    return ClaimShare(ref, tuple(sorted(set(pods))), tuple(sorted(gpus.items())), tuple(sorted(set(cids))),
                      tuple(sorted(set(users) - set(pods))))


def parse_all(raw) -> dict:
    if not isinstance(raw, dict):
        raise ConvgpuError(f"invalid claims {str(raw)[:200]!r}", FIX)
    return {uid: parse(uid, v) for uid, v in raw.items()}


def on_gpu(claims: dict, key: str) -> int:
    """Bytes the claims hold on one GPU (by key)."""
    return sum(dict(c.gpus).get(key, 0) for c in claims.values())


def binding(claims: dict, cid: str | None, pod: str | None) -> tuple:
    """The uids of the claims that bind a container (its id, its pod's uid): those it is matched
    to, else (not matched yet) every claim of its pod; () where none does."""
    if not claims or not (cid or pod):
        return ()
    used = tuple(uid for uid, c in sorted(claims.items()) if cid and cid in c.containers)
    return used or tuple(uid for uid, c in sorted(claims.items()) if c.binds(None, pod))


def budget_limit(claims: dict, uids) -> PodLimit | None:
    """A budget's limit from the claims it holds (those still prepared): on each GPU the sum of
    their shares there, and 0 on any other GPU (named_only); None where it holds none."""
    held = [(u, claims[u]) for u in sorted(set(uids)) if u in claims]
    if not held:
        return None
    split: dict[str, int] = {}
    for _, c in held:
        for k, b in c.gpus:
            split[k] = split.get(k, 0) + b
    refs = [c.ref for _, c in held]   # its runs' job (enforcer/history/): the claims, in their namespace
    job = f"{refs[0].partition('/')[0]}/ResourceClaim/{'+'.join(r.partition('/')[2] for r in refs)}"
    return PodLimit(sum(split.values()), f"{SOURCE} {' + '.join(refs)}", False, tuple(sorted(split.items())),
                    job, named_only=True)


def held_elsewhere(claims: dict, uids) -> PodLimit:
    """The limit of a budget whose containers are bound by claims another budget holds: 0 on
    every GPU. Its first process was placed before the agent told which claim it uses (a pod
    that shares a claim, seen by the agent's next round): its memory cannot be moved into the
    claim's budget, and a budget of its own would count the claim twice."""
    refs = ", ".join(claims[u].ref for u in sorted(uids) if u in claims)
    return PodLimit(0, f"{SOURCE} {refs} (held by another budget: its processes started before the agent "
                       "matched them to it; restart them)", False, (), named_only=True)
