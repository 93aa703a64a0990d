"""Which containers use which DRA claim, for the enforcer (`claim-containers`): the kubelet's
pod-resources API lists, per container, the claims it was given (DynamicResources: the claim's
namespace and name, and the driver of each device), and the pods' container ids come from the
same sources as the device plugin's (kube/pods.py: the API server's watch, the kubelet's log
links). Until a container is matched its pod's claims bound it (enforcer/tenants/claims.py), so
a round that fails or comes late never leaves a container unlimited."""
import logging

from .claims import DRIVER
from .pods import POD_RESOURCES, Assigned, PodSync, list_pods

log = logging.getLogger(__name__)


def list_claims(socket: str = POD_RESOURCES, driver: str = DRIVER, timeout: float = 5.0) -> list[Assigned]:
    """Every container of every pod on the node, with the claims ("namespace/name") it was
    given devices of `driver` from."""
    out = []
    for p in list_pods(socket, timeout):
        for c in p.containers:
            refs = tuple(sorted({f"{d.claim_namespace}/{d.claim_name}" for d in c.dynamic_resources
                                 if any(r.driver_name == driver for r in d.claim_resources)}))
            out.append(Assigned(p.namespace, p.name, c.name, refs))
    return out


class ClaimSync(PodSync):
    """One round (the agent's sync): list, match, tell the enforcer what changed. The pods'
    metadata is PodSync's (its sources and their refresh while a container id is unknown)."""

    def __init__(self, enforcer, sources: list, socket: str = POD_RESOURCES, driver: str = DRIVER):
        super().__init__("", sources, socket=socket)
        self.enforcer, self.driver = enforcer, driver
        self.last: dict = {}

    def round(self) -> dict:
        self.assigned = list_claims(self.socket, self.driver)
        metas = self._metas()
        held = self.enforcer.claims()
        uid_of = {w["claim"]: uid for uid, w in held.items()}
        want: dict[str, set] = {uid: set() for uid in held}
        for a in self.assigned:
            meta = metas.get((a.namespace, a.pod))
            ids = meta.containers.get(a.container, set()) if meta else set()
            for ref in a.devices:
                if ref in uid_of:
                    want[uid_of[ref]] |= ids
        changed = {uid: sorted(ids) for uid, ids in want.items() if sorted(ids) != sorted(held[uid].get("containers", []))}
        if changed:
            self.enforcer.containers(changed)
            log.info("claims matched to containers: %s",
                     ", ".join(f"{held[u]['claim']} {len(ids)}" for u, ids in sorted(changed.items())))
        self.last = {uid: sorted(ids) for uid, ids in want.items()}
        return self.last
