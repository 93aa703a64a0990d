"""Limits from the pods: which container got how many convgpu.io/gpu-memory units (the kubelet's
pod-resources API, List), which container id that container has (the API server, else the
kubelet's /var/log/containers links), and the pod annotation convgpu.io/gpu-memory-limit for
containers without units. The result, {container id or pod uid: (bytes, source)}, goes to the
enforcer's control socket as one `pod-limits` request per change."""
import logging
import os
import re
import time
from dataclasses import dataclass, field

from ..enforcer.tenants.limits import PodLimit
from ..errors import SizeError
from ..units import parse_size
from . import api, devices as dv

log = logging.getLogger(__name__)
ANNOTATION = "convgpu.io/gpu-memory-limit"
POD_RESOURCES = "/var/lib/kubelet/pod-resources/kubelet.sock"
MIN_REFRESH = 2.0   # s between API-server lists while a pod or a limited container is unknown
# The kubelet links every container's log as <pod>_<namespace>_<container>-<64 hex id>.log (the
# layout log shippers read); names are DNS labels/subdomains, so "_" only separates.
_LOG_LINK = re.compile(r"([^_]+)_([^_]+)_(.+)-([0-9a-f]{64})\.log")
# /var/log/pods/<namespace>_<pod>_<uid>/: made before the pod's containers start
_POD_LOG_DIR = re.compile(r"([^_]+)_([^_]+)_([0-9a-f-]{36})")


@dataclass(frozen=True)
class Assigned:
    namespace: str
    pod: str
    container: str
    devices: tuple[str, ...]     # our resource's device ids (empty: the container asked none)


@dataclass
class PodMeta:
    uid: str | None = None
    annotations: dict = field(default_factory=dict)
    # container name -> its 64-hex container ids: a restarted container has a new id, and the
    # kubelet's old log link stays until the old container is collected; old ids cost nothing
    containers: dict = field(default_factory=dict)


def list_assigned(socket: str = POD_RESOURCES, resource: str = dv.RESOURCE, timeout: float = 5.0) -> list[Assigned]:
    """Every container of every pod on the node, with its units of `resource` (List)."""
    import grpc
    m, s = api.podresources()
    with grpc.insecure_channel(api.unix(socket)) as ch:
        resp = s.PodResourcesListerStub(ch).List(m.ListPodResourcesRequest(), timeout=timeout)
    out = []
    for p in resp.pod_resources:
        for c in p.containers:
            ids = tuple(i for d in c.devices if d.resource_name == resource for i in d.device_ids)
            out.append(Assigned(p.namespace, p.name, c.name, ids))
    return out


def _strip_runtime(cid: str) -> str:
    return cid.split("://", 1)[-1]     # containerd://<id>, cri-o://<id>, docker://<id>


class ApiServerPods:
    """This node's pods through the API server (`kubernetes` client: in-cluster config, else
    kubeconfig). Gives uids, annotations and container ids."""

    ttl = 30.0      # seconds between lists of the node's pods, unless one is unknown (PodSync)

    def __init__(self, node: str):
        from kubernetes import client, config   # optional: pip install 'convgpu[k8s]'
        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        self.core = client.CoreV1Api()
        self.node = node

    def pods(self) -> dict[tuple[str, str], PodMeta]:
        out = {}
        for p in self.core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={self.node}").items:
            statuses = (p.status.container_statuses or []) + (p.status.init_container_statuses or []) \
                if p.status else []
            out[(p.metadata.namespace, p.metadata.name)] = PodMeta(
                p.metadata.uid, dict(p.metadata.annotations or {}),
                {s.name: {_strip_runtime(s.container_id)} for s in statuses if s.container_id})
        return out


class KubeletLogPods:
    """This node's pods as the kubelet lays out their logs: no API server needed, but no
    annotations either."""

    def __init__(self, log_root: str = "/var/log"):
        self.root = log_root

    def pods(self) -> dict[tuple[str, str], PodMeta]:
        out: dict[tuple[str, str], PodMeta] = {}
        for name in _listdir(os.path.join(self.root, "pods")):
            m = _POD_LOG_DIR.fullmatch(name)
            if m:
                out.setdefault((m.group(1), m.group(2)), PodMeta()).uid = m.group(3)
        for name in _listdir(os.path.join(self.root, "containers")):
            m = _LOG_LINK.fullmatch(name)
            if m:
                pod, ns, container, cid = m.groups()
                out.setdefault((ns, pod), PodMeta()).containers.setdefault(container, set()).add(cid)
        return out


def _listdir(path):
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


_warned: set[tuple[str, str, str]] = set()


def limits(assigned: list[Assigned], metas: dict[tuple[str, str], PodMeta], unit: int) -> dict[str, PodLimit]:
    """{key: PodLimit}: key is each container's id once it is known, and the pod's uid, so that
    a limit is in place before the container's first CUDA call even if its id is not known yet.

    A container with units gets them (per GPU too: kube/devices.py shares), lowered by the
    pod's annotation if that is smaller; one without units gets the annotation as a bound that
    only lowers what the operator's rules give (lower_only), or, with neither, an entry of 0
    that says "the rules apply" (else it would fall back to its pod's uid entry). The pod's
    uid gets the smallest grant of its containers: a sidecar that comes first never leaves the
    GPU container under the default, and no container is given more than it was granted."""
    pods: dict[tuple[str, str], list[Assigned]] = {}
    for a in assigned:
        pods.setdefault((a.namespace, a.pod), []).append(a)
    out: dict[str, PodLimit] = {}
    for (ns, pod), containers in sorted(pods.items()):
        meta = metas.get((ns, pod), PodMeta())
        ann = _annotation(ns, pod, meta)
        if ann is None and not any(a.devices for a in containers):
            continue   # nothing from the pod: the operator's rules, as for any container
        granted = []
        for a in containers:
            limit = _container(ns, pod, a, ann, unit)
            if not limit.lower_only:
                granted.append(limit)
            for cid in sorted(meta.containers.get(a.container, ())):
                out[cid] = limit
        if meta.uid:
            out[meta.uid] = min(granted) if granted else \
                PodLimit(ann, f"pod {ns}/{pod} annotation {ANNOTATION}", True)
    return out


def _annotation(ns: str, pod: str, meta: PodMeta) -> int | None:
    ann = meta.annotations.get(ANNOTATION)
    if ann is None:
        return None
    try:
        return parse_size(ann, f"annotation {ANNOTATION} of {ns}/{pod}")
    except SizeError as e:
        if (ns, pod, ann) not in _warned:   # once per pod and value, not every round
            _warned.add((ns, pod, ann))
            log.warning("%s; the container keeps its other limit", e)
        return None


def _container(ns: str, pod: str, a: Assigned, ann: int | None, unit: int) -> PodLimit:
    if not a.devices:
        if ann is None:
            return PodLimit(0, f"pod {ns}/{pod} {a.container}: no {dv.RESOURCE}", True)
        return PodLimit(ann, f"pod {ns}/{pod} annotation {ANNOTATION}", True)
    total = len(a.devices) * unit
    source = f"pod {ns}/{pod} {a.container}: {len(a.devices)} x {unit >> 20} MiB {dv.RESOURCE}"
    split = dv.shares(a.devices, unit)
    if ann is not None and ann < total:   # the author may ask for less than the units, not more
        total, source = ann, f"{source}, lowered by annotation {ANNOTATION}"
        split = {k: min(v, ann) for k, v in split.items()}
    return PodLimit(total, source, False, tuple(split.items()))


def _unresolved(assigned: list[Assigned], metas: dict[tuple[str, str], PodMeta]) -> bool:
    for a in assigned:
        meta = metas.get((a.namespace, a.pod))
        if meta is None:
            return True
        if (a.devices or ANNOTATION in meta.annotations) and not meta.containers.get(a.container):
            return True
    return False


class PodSync:
    """One round: list, resolve, and tell the enforcer when the result changed (or the enforcer
    restarted: it then knows nothing, so each round re-sends when the enforcer's pid differs)."""

    def __init__(self, control: str, sources: list, unit: int = dv.UNIT, socket: str = POD_RESOURCES,
                 resource: str = dv.RESOURCE, clock=time.monotonic):
        self.clock = clock
        self.control, self.sources, self.unit, self.socket, self.resource = control, sources, unit, socket, resource
        self.sent: tuple | None = None
        self.last: dict[str, PodLimit] = {}
        self.assigned: list[Assigned] = []
        self._cache: dict[int, tuple[float, dict]] = {}

    def _metas(self) -> dict[tuple[str, str], PodMeta]:
        """What the sources know, merged (container ids: all of them). A source with a `ttl` (the
        API server: one list of the node's pods costs the API server, and every node asks) is
        asked again after ttl seconds, or sooner (MIN_REFRESH) while a listed pod or a container
        that has a limit is unknown to it: a new pod, a new container id."""
        now = self.clock()
        metas: dict[tuple[str, str], PodMeta] = {}
        for i, src in enumerate(self.sources):
            ttl = getattr(src, "ttl", 0.0)
            at, known = self._cache.get(i, (None, {}))
            if at is None or now - at >= ttl or (now - at >= MIN_REFRESH and _unresolved(self.assigned, known)):
                known = src.pods()
                self._cache[i] = (now, known)
            for k, v in known.items():
                m = metas.setdefault(k, PodMeta())
                m.uid = m.uid or v.uid
                m.annotations = {**v.annotations, **m.annotations}   # the first source wins
                for name, ids in v.containers.items():
                    m.containers.setdefault(name, set()).update(ids)
        return metas

    def round(self) -> dict[str, PodLimit]:
        from ..enforcer.serving.server import request
        self.assigned = list_assigned(self.socket, self.resource)
        want = limits(self.assigned, self._metas(), self.unit)
        pid = request(self.control, {"cmd": "ping"})["pid"]
        if (pid, want) != self.sent:
            r = request(self.control, {"cmd": "pod-limits", "limits": {k: v.wire() for k, v in want.items()}})
            if not r.get("ok"):
                raise RuntimeError(r.get("error"))
            log.info("pod limits: %d container(s) and pod(s) sent to the enforcer", len(want))
            self.sent = (pid, want)
        self.last = want
        return want
