"""The DRA kubelet plugin (`convgpu kube --dra`, issue 40): the GPUs published as one ResourceSlice
with a consumable `memory` capacity (kube/slices.py), and each claim the scheduler allocated on
them held to its share by the enforcer.

- Registration: a socket in the kubelet's plugins_registry dir serves pluginregistration v1
  (GetInfo: type DRAPlugin, our endpoint, the services v1.DRAPlugin and v1beta1.DRAPlugin; the
  kubelet takes the first it speaks). A restarted kubelet finds the socket again and asks anew.
- NodePrepareResources (v1 and v1beta1): per claim, read it from the API server, check it
  (kube/claims.py), write its CDI spec (the GPU's nodes, the shim and its environment), and hand
  its shares to the enforcer (`claim-prepare`), which keeps them in its state dir before it
  answers: the pod's containers are limited from their first CUDA call, through a kill -9 of this
  plugin or of the enforcer. Each claim gets its own error; a refused claim leaves nothing behind
  and nothing else changes. Preparing a claim again is a no-op that answers the same.
- NodeUnprepareResources: the enforcer drops the claim's entry; the CDI spec goes.
- DRAResourceHealth v1alpha1 (the kubelet asks when its ResourceHealthStatus gate is on): every
  GPU's health, again at each change. A lost or unhealthy GPU also leaves the ResourceSlice.
Which container uses which claim comes from the kubelet's pod-resources API (DynamicResources per
container: kube/drasync.py)."""
import json
import logging
import os
import tempfile
import threading
import time
from concurrent import futures

from . import api, devices as dv
from .claims import CDI_KIND, DRIVER, Claim, ClaimError, cdi_name, cdi_spec, check_request, device_name, read
from .plugin import Serving

log = logging.getLogger(__name__)
REGISTRY_DIR = "/var/lib/kubelet/plugins_registry"
PLUGINS_DIR = "/var/lib/kubelet/plugins"
CDI_DIR = "/var/run/cdi"
SOCKET = "dra.sock"


class Enforcer:
    """The enforcer's control socket, as the DRA plugin uses it."""

    def __init__(self, control: str, timeout: float = 10.0):
        self.control, self.timeout = control, timeout

    def _ask(self, msg: dict) -> dict:
        from ..enforcer.serving.server import request
        try:
            r = request(self.control, msg, self.timeout)
        except (OSError, ValueError) as e:
            raise ClaimError(f"the enforcer does not answer on {self.control} ({e}); the kubelet asks "
                             "again") from None
        if not r.get("ok"):
            raise ClaimError(str(r.get("error"))[:500])
        return r

    def prepare(self, uid: str, wire: dict) -> bool:
        return self._ask({"cmd": "claim-prepare", "uid": uid, "claim": wire})["changed"]

    def unprepare(self, uid: str) -> bool:
        return self._ask({"cmd": "claim-unprepare", "uid": uid})["changed"]

    def containers(self, mapping: dict) -> bool:
        return self._ask({"cmd": "claim-containers", "containers": mapping})["changed"]

    def claims(self) -> dict:
        return self._ask({"cmd": "claim-list"})["claims"]


class CdiDir:
    """One spec per claim, <dir>/convgpu-claim-<uid>.json, written whole (temporary file and
    rename: the runtime reads the old spec or the new one, never half)."""

    def __init__(self, path: str = CDI_DIR):
        self.dir = path

    def path(self, uid: str) -> str:
        return os.path.join(self.dir, f"convgpu-claim-{uid}.json")   # uid checked (claims.check_request)

    def write(self, uid: str, spec: dict):
        os.makedirs(self.dir, mode=0o755, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".convgpu-claim-", dir=self.dir)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(spec, f, indent=1, sort_keys=True)
            os.chmod(tmp, 0o644)
            os.replace(tmp, self.path(uid))
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def remove(self, uid: str):
        try:
            os.unlink(self.path(uid))
        except FileNotFoundError:
            pass


def make_dirs(path: str) -> list[str]:
    """os.makedirs(path) (0750); returns the directories it made, which were not there before."""
    made, d = [], os.path.abspath(path)
    while not os.path.isdir(d):
        made.append(d)
        d = os.path.dirname(d)
    os.makedirs(path, mode=0o750, exist_ok=True)
    return made


class DraPlugin(Serving):
    def __init__(self, node: str, gpus: list, read_claim, enforcer: Enforcer, cdi: CdiDir,
                 registry_dir: str = REGISTRY_DIR, plugins_dir: str = PLUGINS_DIR, driver: str = DRIVER,
                 slices=None, shim: dv.ShimOffer | None = None, cdi_kind: str = dv.CDI_KIND,
                 dev_root: str = "/dev", facts=None):
        """read_claim(namespace, name) -> the claim (the `kubernetes` client's model); slices:
        kube/slices.Slices or None; facts() -> {GPU key: model, architecture, driver}."""
        self.node, self.read_claim, self.enforcer, self.cdi = node, read_claim, enforcer, cdi
        self.driver, self.slices, self.shim, self.cdi_kind, self.dev_root = driver, slices, shim, cdi_kind, dev_root
        self.facts = facts or (lambda: {})
        self.reg_socket = os.path.join(registry_dir, f"{driver}-reg.sock")
        self.socket = os.path.join(plugins_dir, driver, SOCKET)
        for path in (self.reg_socket, self.socket):
            if len(os.fsencode(os.path.abspath(path))) > 107:   # sun_path: 108 bytes with its NUL
                from ..errors import ConfigError
                raise ConfigError(f"socket path {path} is longer than a UNIX socket's 107 bytes",
                                  "give a shorter --registry-dir / --plugins-dir (the kubelet's are short)")
        self.gpus: list = []
        self.bad: set[str] = set()
        self.version = 0               # changes of what is published (health stream)
        self.changed = threading.Condition()
        self.lock = threading.Lock()   # one Prepare or Unprepare at a time
        self.prepared: dict[str, Claim] = {}   # uid -> the claim as prepared by this process
        self.registered = 0            # NotifyRegistrationStatus(registered) calls
        self.server = None
        self.stopping = False
        self.made: list[str] = []      # directories serve() made: close() removes them if empty
        self.set_gpus(gpus)

    # --- what is published ---
    def devices(self) -> dict:
        """{device name: Gpu} of the GPUs published now (healthy ones)."""
        with self.changed:
            return {device_name(g): g for g in self.gpus if g.key not in self.bad}

    def _changed(self):
        with self.changed:
            self.version += 1
            self.changed.notify_all()
        self.publish()

    def set_gpus(self, gpus: list):
        if list(gpus) != self.gpus:
            self.gpus = list(gpus)
            self._changed()
        else:
            self.publish()   # a publish that failed earlier is tried again

    def set_health(self, bad: set):
        if set(bad) != self.bad:
            log.warning("%s: unhealthy GPU(s): %s", self.driver, ", ".join(sorted(bad)) or "none")
            self.bad = set(bad)
            self._changed()

    def publish(self):
        if self.slices is None:
            return
        try:
            self.slices.publish(list(self.devices().values()), self.facts())
        except Exception as e:    # the API server: the next inventory round tries again
            log.warning("ResourceSlice not published: %s", str(e)[:300])

    # --- the kubelet's calls ---
    def prepare_one(self, uid: str, namespace: str, name: str) -> Claim:
        check_request(uid, namespace, name)
        from kubernetes.client.exceptions import ApiException
        try:
            obj = self.read_claim(namespace, name)
        except ApiException as e:
            raise ClaimError(f"claim {namespace}/{name}: the API server says {e.status} {e.reason}") from None
        except ClaimError:
            raise
        except Exception as e:   # a malformed object the client cannot read, the network
            raise ClaimError(f"claim {namespace}/{name} cannot be read: {str(e).splitlines()[0][:300]}") from None
        claim = read(obj, uid, namespace, name, self.node, self.devices(), self.driver)
        self.cdi.write(uid, cdi_spec(claim, self.dev_root, self.shim))
        try:
            new = self.enforcer.prepare(uid, claim.wire())
        except ClaimError:
            if uid not in self.prepared:
                self.cdi.remove(uid)   # refused: nothing of it stays
            raise
        self.prepared[uid] = claim
        log.info("claim %s (%s) prepared%s: %s", claim.ref, uid, "" if new else " again",
                 ", ".join(f"{r.bytes >> 20} MiB on {r.gpu.key}" for r in claim.results))
        return claim

    def answer(self, claim: Claim, version: str) -> list:
        m, _ = api.dra(version)
        out = []
        for r in claim.results:
            ids = [f"{CDI_KIND}={cdi_name(claim, r)}"] + ([f"{self.cdi_kind}={r.gpu.visible}"] if self.cdi_kind else [])
            extra = {"share_id": r.share_id} if version == "v1" and r.share_id else {}
            out.append(m.Device(request_names=[r.request], pool_name=self.node, device_name=r.device,
                                cdi_device_ids=ids, **extra))
        return out

    def prepare(self, request, version: str):
        m, _ = api.dra(version)
        out = {}
        with self.lock:
            for c in list(request.claims)[:1024]:
                try:
                    out[c.uid] = m.NodePrepareResourceResponse(devices=self.answer(self.prepare_one(c.uid, c.namespace, c.name), version))
                except (ClaimError, OSError) as e:
                    log.warning("claim %s/%s (%s) not prepared: %s", c.namespace, c.name, c.uid, e)
                    out[c.uid] = m.NodePrepareResourceResponse(error=str(e))
        return m.NodePrepareResourcesResponse(claims=out)

    def unprepare(self, request, version: str):
        m, _ = api.dra(version)
        out = {}
        with self.lock:
            for c in list(request.claims)[:1024]:
                try:
                    check_request(c.uid, c.namespace, c.name)
                    self.enforcer.unprepare(c.uid)
                    self.cdi.remove(c.uid)
                    self.prepared.pop(c.uid, None)
                    log.info("claim %s/%s (%s) unprepared", c.namespace, c.name, c.uid)
                    out[c.uid] = m.NodeUnprepareResourceResponse()
                except (ClaimError, OSError) as e:
                    out[c.uid] = m.NodeUnprepareResourceResponse(error=str(e))
        return m.NodeUnprepareResourcesResponse(claims=out)

    def health(self, context):
        m, _ = api.drahealth()
        seen = -1
        while context.is_active() and not self.stopping:
            with self.changed:
                if self.version == seen:
                    self.changed.wait(timeout=0.5)
                    continue
                seen, gpus, bad = self.version, list(self.gpus), set(self.bad)
            now = int(time.time())
            yield m.NodeWatchResourcesResponse(devices=[m.DeviceHealth(
                device=m.DeviceIdentifier(pool_name=self.node, device_name=device_name(g)),
                health=m.UNHEALTHY if g.key in bad else m.HEALTHY, last_updated_time=now,
                message="NVML error or critical XID" if g.key in bad else "") for g in gpus])

    # --- serving ---
    def serve(self):
        import grpc
        self._stop_server()
        for path in (self.reg_socket, self.socket):
            self.made += make_dirs(os.path.dirname(path))
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        for add in _servicers(self):
            add(self.server)
        # the DRA services first, then the registration socket: the kubelet dials our endpoint
        # as soon as it has read GetInfo
        self.server.add_insecure_port(api.unix(self.socket))
        self.server.add_insecure_port(api.unix(self.reg_socket))
        self.server.start()
        log.info("DRA plugin %s: registration %s, endpoint %s", self.driver, self.reg_socket, self.socket)

    def check(self):
        """Serve again when a socket went (removed by hand, a plugins dir wiped)."""
        if self.server is None or not (os.path.exists(self.socket) and os.path.exists(self.reg_socket)):
            self.serve()

    def close(self):
        """Stop serving; the registration socket goes, so the kubelet unregisters the plugin."""
        self.stopping = True
        self._stop_server()
        for path in (self.reg_socket, self.socket):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        for d in sorted(set(self.made), key=len, reverse=True):   # what we made, if left empty (issue 52)
            try:
                os.rmdir(d)
            except OSError:
                pass
        self.made = []


def _servicers(p: DraPlugin) -> list:
    """add(server) for each service: registration, DRAPlugin v1 and v1beta1, health v1alpha1."""
    rm, rs = api.registration()
    hm, hs = api.drahealth()

    class Registration(rs.RegistrationServicer):
        def GetInfo(self, request, context):
            return rm.PluginInfo(type=api.DRA_PLUGIN_TYPE, name=p.driver, endpoint=p.socket,
                                 supported_versions=list(api.DRA_SERVICES))

        def NotifyRegistrationStatus(self, request, context):
            if request.plugin_registered:
                p.registered += 1
                log.info("registered with the kubelet as DRA driver %s", p.driver)
            else:
                log.error("the kubelet refused DRA driver %s: %s", p.driver, request.error)
            return rm.RegistrationStatusResponse()

    class Health(hs.DRAResourceHealthServicer):
        def NodeWatchResources(self, request, context):
            yield from p.health(context)

    out = [lambda s: rs.add_RegistrationServicer_to_server(Registration(), s),
           lambda s: hs.add_DRAResourceHealthServicer_to_server(Health(), s)]
    for v in api.DRA_VERSIONS:
        _, ds = api.dra(v)
        servicer = type(f"DRAPlugin_{v}", (ds.DRAPluginServicer,), {
            "NodePrepareResources": lambda self, request, context, v=v: p.prepare(request, v),
            "NodeUnprepareResources": lambda self, request, context, v=v: p.unprepare(request, v)})()
        out.append(lambda s, ds=ds, servicer=servicer: ds.add_DRAPluginServicer_to_server(servicer, s))
    return out
