"""A ResourceClaim the scheduler allocated on this node, read as convgpu must honour it (pure:
no gRPC, no API server, no files; tests/unit/test_dra_claims.py).

The claim is an API object a tenant shapes (its names, its sizes: `capacity.requests.memory`),
so everything in it is checked here, with one line per claim that says what is wrong: the uid
the kubelet asked for, an allocation by this driver in this node's pool, devices this node
publishes (a GPU lost since is refused), a `consumedCapacity.memory` in every result (the
scheduler writes it when DRAConsumableCapacity is on and the device allows multiple
allocations), a size that is a Kubernetes quantity, above 0 and within the GPU, and at least
one pod it is reserved for. Caps: MAX_RESULTS results, MAX_QUANTITY characters a quantity.
A result with adminAccess (a monitoring pod's: DRAAdminAccess, only in namespaces an admin
labelled) is not a share of the GPU: the scheduler allocates it beside the others without
counting it, so it holds nothing and limits nothing (issue 48: it was counted as a share, and
refused on a busy GPU)."""
import math
import re
from dataclasses import dataclass

from . import devices as dv

DRIVER = "gpu-memory.convgpu.io"   # the DRA driver's name, the DeviceClass's too
CAPACITY = "memory"                # the consumable capacity each GPU publishes
MAX_RESULTS = 32                   # AllocationResultsMaxSize
MAX_QUANTITY = 32                  # "137438953472", "1.5Gi", "128e9": a size is short
_UID = re.compile(r"[0-9A-Za-z][0-9A-Za-z-]{0,63}")
_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")   # DNS subdomain (names, namespaces)
_QUANTITY_CHARS = re.compile(r"[0-9A-Za-z.+-]+")
_SHARE = re.compile(r"[0-9A-Za-z][0-9A-Za-z-]{0,63}")


class ClaimError(Exception):
    """One claim that cannot be honoured: one line, returned as that claim's error."""


@dataclass(frozen=True)
class Result:
    request: str
    device: str
    gpu: dv.Gpu
    bytes: int
    share_id: str | None
    admin: bool = False      # adminAccess: no share (bytes 0)


@dataclass(frozen=True)
class Claim:
    uid: str
    namespace: str
    name: str
    pods: tuple        # uids of the pods it is reserved for
    results: tuple     # Result, ours only

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"

    def gpus(self) -> dict[str, int]:
        """{GPU key: bytes}: several results on one GPU add up; adminAccess results hold none."""
        out: dict[str, int] = {}
        for r in self.results:
            if not r.admin:
                out[r.gpu.key] = out.get(r.gpu.key, 0) + r.bytes
        return out

    def wire(self) -> dict:
        """The enforcer's entry (enforcer/tenants/claims.py)."""
        return {"claim": self.ref, "pods": list(self.pods), "gpus": self.gpus()}


def quantity(raw, what: str) -> int:
    """Bytes of a Kubernetes quantity ("12Gi", "1.5G", "500M", "128e9"), rounded up to a whole
    byte as the scheduler's Quantity.Value() does; ClaimError otherwise."""
    from kubernetes.utils import parse_quantity
    # the client's parser skips blanks that the API's refuses: only a quantity's characters pass
    if not isinstance(raw, str) or not 0 < len(raw) <= MAX_QUANTITY or not _QUANTITY_CHARS.fullmatch(raw):
        raise ClaimError(f"{what} {str(raw)[:40]!r} is not a quantity")
    try:
        q = parse_quantity(raw)
    except (ValueError, ArithmeticError):
        raise ClaimError(f"{what} {raw!r} is not a quantity (write it like 12Gi, 1.5G or 500M)") from None
    if not q.is_finite() or q <= 0:
        raise ClaimError(f"{what} {raw!r} is not above 0")
    if q > 1 << 62:
        raise ClaimError(f"{what} {raw!r} is larger than any GPU")
    return int(math.ceil(q))


def device_name(g: dv.Gpu) -> str:
    """The device's name in the ResourceSlice (a DNS label): from the GPU's uuid, which stays
    when GPUs are numbered anew after a reboot (a claim's device then still means its GPU)."""
    if g.uuid:
        return "gpu-" + re.sub(r"[^a-z0-9-]", "-", g.uuid.lower().removeprefix("gpu-"))[:59].strip("-")
    return f"gpu-{g.index}"


def read(obj, uid: str, namespace: str, name: str, pool: str, devices: dict, driver: str = DRIVER) -> Claim:
    """The claim (the `kubernetes` client's ResourceV1ResourceClaim) as convgpu honours it.
    devices: {device name: dv.Gpu} as published now."""
    meta, status = getattr(obj, "metadata", None), getattr(obj, "status", None)
    if meta is None or meta.uid != uid:
        raise ClaimError(f"claim {namespace}/{name} has uid {getattr(meta, 'uid', None)!r}, not {uid!r} as "
                         "the kubelet asks (deleted and made again?)")
    if meta.namespace != namespace or meta.name != name:
        raise ClaimError(f"claim {uid} is {meta.namespace}/{meta.name}, not {namespace}/{name}")
    alloc = getattr(status, "allocation", None)
    results = list(getattr(getattr(alloc, "devices", None), "results", None) or [])
    ours = [r for r in results if r.driver == driver]
    if not ours:
        raise ClaimError(f"claim {namespace}/{name} has no allocation by {driver}")
    if len(results) > MAX_RESULTS:
        raise ClaimError(f"claim {namespace}/{name} has {len(results)} results, more than {MAX_RESULTS}")
    out = []
    for r in ours:
        out.append(_result(r, f"claim {namespace}/{name} request {str(r.request)[:63]!r}", pool, devices))
    pods = tuple(sorted({c.uid for c in (status.reserved_for or []) if c.resource == "pods" and not c.api_group
                         and isinstance(c.uid, str) and _UID.fullmatch(c.uid)}))
    if not pods:
        raise ClaimError(f"claim {namespace}/{name} is reserved for no pod")
    return Claim(uid, namespace, name, pods, tuple(out))


def _result(r, what: str, pool: str, devices: dict) -> Result:
    if r.pool != pool:
        raise ClaimError(f"{what}: pool {str(r.pool)[:80]!r} is not this node's ({pool})")
    gpu = devices.get(r.device)
    if gpu is None:
        raise ClaimError(f"{what}: device {str(r.device)[:80]!r} is not a GPU this node has now (lost?); "
                         f"it has {', '.join(sorted(devices)) or 'none'}")
    share = r.share_id
    if share is not None and not (isinstance(share, str) and _SHARE.fullmatch(share)):
        raise ClaimError(f"{what}: shareID {str(share)[:80]!r} is not one")
    if r.admin_access is True:   # beside the shares, counted by no one: nothing to hold it to
        return Result(str(r.request), r.device, gpu, 0, share, admin=True)
    consumed = r.consumed_capacity or {}
    if CAPACITY not in consumed:
        raise ClaimError(f"{what}: no consumedCapacity.{CAPACITY} (the DRAConsumableCapacity feature gate "
                         "must be on in the API server and the scheduler)")
    size = quantity(consumed[CAPACITY], f"{what}: consumedCapacity.{CAPACITY}")
    if size > gpu.capacity:
        raise ClaimError(f"{what}: consumedCapacity.{CAPACITY} {consumed[CAPACITY]} is past GPU {gpu.key}'s "
                         f"{gpu.capacity} bytes")
    return Result(str(r.request), r.device, gpu, size, share)


def check_request(uid: str, namespace: str, name: str) -> None:
    """The kubelet's Claim message (uid, namespace, name): the names go into an API path and
    the uid into a file name (the CDI spec), so they are checked before either."""
    if not (isinstance(uid, str) and _UID.fullmatch(uid)):
        raise ClaimError(f"claim uid {str(uid)[:80]!r} is not one")
    for v, what in ((namespace, "namespace"), (name, "name")):
        if not (isinstance(v, str) and _NAME.fullmatch(v) and len(v) <= (63 if what == "namespace" else 253)):
            raise ClaimError(f"claim {what} {str(v)[:80]!r} is not one")
