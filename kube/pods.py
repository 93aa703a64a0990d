"""Limits from the pods: which container got how many convgpu.io/gpu-memory units (the kubelet's
pod-resources API, List), which container id that container has (the API server, else the
kubelet's /var/log/containers links), and the pod annotation convgpu.io/gpu-memory-limit, which
only lowers a limit. The result, {container id or pod uid: PodLimit} (with each GPU's share of a
grant), goes to the enforcer's control socket as one `pod-limits` request per change."""
import logging
import os
import re
import threading
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
    # its controller, Kind/name ("": none known): the job its runs are kept under (owner())
    owner: str = ""


def owner(references, labels: dict | None) -> str:
    """The pod's controller as Kind/name: a Deployment's pods are owned by a ReplicaSet named
    <deployment>-<pod-template-hash>, so that hash (the pod's label) is cut off; a Job, a
    StatefulSet, a DaemonSet as they are. A pod's author sets its ownerReferences, but only
    within its own namespace, and the job's key starts with the namespace (enforcer/history/jobs.py)."""
    for o in references or ():
        if getattr(o, "controller", False):
            h = (labels or {}).get("pod-template-hash", "")
            if o.kind == "ReplicaSet" and h and o.name.endswith("-" + h):
                return f"Deployment/{o.name[:-len(h) - 1]}"
            return f"{o.kind}/{o.name}"
    return ""


def api_client():
    """The API server's client: the pod's service account (in-cluster), else the kubeconfig."""
    from kubernetes import client, config   # optional: pip install 'convgpu[k8s]'
    try:
        config.load_incluster_config()
    except config.ConfigException:   # KUBECONFIG read now: the client reads it once, at import
        config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))
    return client.ApiClient()


def list_pods(socket: str = POD_RESOURCES, timeout: float = 5.0) -> list:
    """The kubelet's pod-resources List: every pod on the node (v1.PodResources messages)."""
    import grpc
    m, s = api.podresources()
    with grpc.insecure_channel(api.unix(socket)) as ch:
        return list(s.PodResourcesListerStub(ch).List(m.ListPodResourcesRequest(), timeout=timeout).pod_resources)


def list_assigned(socket: str = POD_RESOURCES, resource: str = dv.RESOURCE, timeout: float = 5.0) -> list[Assigned]:
    """Every container of every pod on the node, with its units of `resource` (List)."""
    out = []
    for p in list_pods(socket, timeout):
        for c in p.containers:
            ids = tuple(i for d in c.devices if d.resource_name == resource for i in d.device_ids)
            out.append(Assigned(p.namespace, p.name, c.name, ids))
    return out


def _strip_runtime(cid: str) -> str:
    return cid.split("://", 1)[-1]     # containerd://<id>, cri-o://<id>, docker://<id>


class ApiServerPods:
    """This node's pods through the API server (`kubernetes` client: in-cluster config, else
    kubeconfig): uids, annotations and container ids, kept by a watch, as an informer does.

    One list, served from the API server's watch cache (resourceVersion=0: no quorum read of
    etcd), then a watch from that version in a thread of its own; pods() answers from what the
    watch has told, without asking the API server. The watch is restarted from its last version
    when the server closes it (timeoutSeconds), and the list is done again only when that version
    is gone (410) or the connection failed; a node's agent then costs the API server one watch
    instead of a list every two seconds while a new pod's container id is unknown."""

    ttl = 0.0           # pods() is the watch's cache: PodSync may ask it every round
    watch_timeout = 300  # seconds a watch request lasts before it is made again (the server's cap)

    def __init__(self, node: str, start: bool = True):
        from kubernetes import client   # optional: pip install 'convgpu[k8s]'
        self.core = client.CoreV1Api(api_client())
        self.node = node
        self.lists = 0           # lists done (tests: one, unless the watch lost its version)
        self._pods: dict[tuple[str, str], PodMeta] = {}
        self._version = None
        self._synced = threading.Event()
        self.stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pod-watch", daemon=True)
        if start:
            self._thread.start()

    @staticmethod
    def _meta(p) -> PodMeta:
        statuses = (p.status.container_statuses or []) + (p.status.init_container_statuses or []) \
            if p.status else []
        return PodMeta(p.metadata.uid, dict(p.metadata.annotations or {}),
                       {s.name: {_strip_runtime(s.container_id)} for s in statuses if s.container_id},
                       owner(p.metadata.owner_references, p.metadata.labels))

    def _list(self):
        got = self.core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={self.node}",
                                                    resource_version="0", resource_version_match="NotOlderThan")
        self.lists += 1
        self._pods = {(p.metadata.namespace, p.metadata.name): self._meta(p) for p in got.items}
        self._version = got.metadata.resource_version
        self._synced.set()

    def _watch(self):
        from kubernetes import watch
        w = watch.Watch()
        for ev in w.stream(self.core.list_pod_for_all_namespaces, field_selector=f"spec.nodeName={self.node}",
                           resource_version=self._version, allow_watch_bookmarks=True,
                           timeout_seconds=self.watch_timeout, _request_timeout=self.watch_timeout + 30):
            if self.stop.is_set():
                w.stop()
                return
            kind, p = ev["type"], ev["object"]
            if kind == "ERROR":
                raise _Gone()
            self._version = p.metadata.resource_version or self._version
            key = (p.metadata.namespace, p.metadata.name)
            if kind == "DELETED":
                self._pods = {k: v for k, v in self._pods.items() if k != key}
            elif kind in ("ADDED", "MODIFIED"):
                self._pods = {**self._pods, key: self._meta(p)}   # one swap: readers see old or new

    def _run(self):
        from kubernetes.client.exceptions import ApiException
        delay = 1.0
        while not self.stop.is_set():
            try:
                if self._version is None:
                    self._list()
                self._watch()          # returns when the server ends the watch: again from its version
                delay = 1.0
            except (_Gone, ApiException) as e:
                if getattr(e, "status", 410) == 410:
                    self._version = None          # the version is gone: list again
                log.warning("pod watch: %s; again in %.0f s", str(e)[:200] or "resource version gone", delay)
                self.stop.wait(delay)
                delay = min(delay * 2, 30.0)
            except Exception as e:     # the API server restarting, the network
                self._version = None
                log.warning("pod watch: %s; listing again in %.0f s", str(e)[:200], delay)
                self.stop.wait(delay)
                delay = min(delay * 2, 30.0)

    def pods(self, wait: float = 5.0) -> dict[tuple[str, str], PodMeta]:
        """What the watch knows now (after the first list, waited for up to `wait` s)."""
        self._synced.wait(wait)
        return dict(self._pods)


class _Gone(Exception):
    """The watch's resource version is too old (an ERROR event, 410 Gone)."""


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
        for a in containers:   # its job: its controller (the API server's word), else the pod itself
            limit = _container(ns, pod, a, ann, unit)._replace(job=f"{ns}/{meta.owner or 'Pod/' + pod}/{a.container}")
            if not limit.lower_only:
                granted.append(limit)
            for cid in sorted(meta.containers.get(a.container, ())):
                out[cid] = limit
        if meta.uid:   # a pod of one container: that container's job too
            out[meta.uid] = min(granted) if granted else PodLimit(
                ann, f"pod {ns}/{pod} annotation {ANNOTATION}", True, (), limit.job if len(containers) == 1 else "")
    return out


def _annotation(ns: str, pod: str, meta: PodMeta) -> int | None:
    ann = meta.annotations.get(ANNOTATION)
    if ann is None:
        return None
    try:
        return parse_size(ann, f"annotation {ANNOTATION} of {ns}/{pod}", bare=True)
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
        """What the sources know, merged (container ids: all of them). A source with a `ttl` (one
        that costs to ask; ApiServerPods has none: it answers from its watch) is
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
                m.owner = m.owner or v.owner
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
