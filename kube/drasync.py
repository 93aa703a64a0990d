"""Which containers and pods use which DRA claim, for the enforcer (`claim-containers`): the
kubelet's pod-resources API lists, per container, the claims it was given (DynamicResources: the
claim's namespace and name, and the driver of each device), and the pods' uids and container ids
come from the same sources as the device plugin's (kube/pods.py: the API server's watch, the
kubelet's log links). A claim's second pod is known only from here (issue 48: the kubelet
prepares a shared claim once, for the pods reserved then), so its uid goes to the enforcer too,
and its containers are charged to the claim's budget. Until a container is matched its pod's
claims bind it (enforcer/tenants/claims.py)."""
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

    def __init__(self, enforcer, sources: list, socket: str = POD_RESOURCES, driver: str = DRIVER, settle=None):
        """settle(): the plugin's (kube/dra.py DraPlugin.settle), claims told failed taken back."""
        super().__init__("", sources, socket=socket)
        self.enforcer, self.driver, self.settle = enforcer, driver, settle
        self.last: dict = {}

    def round(self) -> dict:
        """{claim uid: {"containers": [ids], "users": [pod uids]}} as sent (what changed is)."""
        if self.settle is not None:
            self.settle()
        self.assigned = list_claims(self.socket, self.driver)
        metas = self._metas()
        held = self.enforcer.claims()
        uid_of = {w["claim"]: uid for uid, w in held.items()}
        want = {uid: {"containers": set(), "users": set()} for uid in held}
        for a in self.assigned:
            meta = metas.get((a.namespace, a.pod))
            for ref in a.devices:
                if ref in uid_of and meta is not None:
                    want[uid_of[ref]]["containers"] |= meta.containers.get(a.container, set())
                    if meta.uid:
                        want[uid_of[ref]]["users"].add(meta.uid)
        got = {uid: {"containers": sorted(w["containers"]), "users": sorted(w["users"] - set(held[uid]["pods"]))}
               for uid, w in want.items()}
        changed = {uid: w for uid, w in got.items()
                   if (w["containers"], w["users"]) != (sorted(held[uid].get("containers", [])),
                                                        sorted(held[uid].get("users", [])))}
        if changed:
            self.enforcer.containers(changed)
            log.info("claims matched: %s", ", ".join(f"{held[u]['claim']} {len(w['containers'])} container(s), "
                                                     f"{len(w['users'])} more pod(s)" for u, w in sorted(changed.items())))
        self.last = got
        return got
