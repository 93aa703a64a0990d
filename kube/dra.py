"""The DRA kubelet plugin (`convgpu kube --dra`, issue 40): the GPUs published as one ResourceSlice
with a consumable `memory` capacity (kube/slices.py), and each claim the scheduler allocated on
them held to its share by the enforcer.

- Registration: a socket in the kubelet's plugins_registry dir serves pluginregistration v1
  (GetInfo: type DRAPlugin, our endpoint, the services v1.DRAPlugin and v1beta1.DRAPlugin; the
  kubelet takes the first it speaks). A restarted kubelet finds the socket again and asks anew.
- NodePrepareResources (v1 and v1beta1): per claim, read it from the API server, check it
  (kube/claims.py), write its CDI spec (kube/cdi.py: the GPU's nodes, the shim and its
  environment, checked as a runtime checks it); then the request's claims go to the enforcer in
  one call (`claim-prepare`), which decides them together and keeps them in its state dir before
  it answers: the pod's containers are limited from their first CUDA call, through a kill -9 of
  this plugin or of the enforcer. Each claim gets its own answer, every claim of the request one
  (issue 48: past 1,024 claims, some got none); a refused claim leaves nothing behind and
  nothing else changes. Preparing a claim again is a no-op that answers the same. An
  adminAccess claim holds no share: it is not sent.
- One deadline per request (TIMEOUT, or the kubelet's own if sooner), not per claim (issue 48:
  a stalled enforcer cost 10 s a claim). The enforcer keeps nothing it reads after the
  deadline; claims whose reply never came are taken back at the next contact (settle()) unless
  the kubelet has prepared them since, so nothing the kubelet was told had failed stays held.
- NodeUnprepareResources: the enforcer drops the claims' entries (one call); the CDI specs go.
- DRAResourceHealth v1alpha1 (the kubelet asks when its ResourceHealthStatus gate is on): every
  GPU's health, again at each change. A lost or unhealthy GPU also leaves the ResourceSlice.
Which container uses which claim comes from the kubelet's pod-resources API (DynamicResources per
container: kube/drasync.py)."""
import logging
import os
import threading
import time
from concurrent import futures

from . import api, cdi, devices as dv
from .cdi import DIR as CDI_DIR, CdiDir  # noqa: F401  (the CLI and the tests import them from here)
from .claims import DRIVER, Claim, ClaimError, check_request, device_name, read
from .plugin import Serving

log = logging.getLogger(__name__)
REGISTRY_DIR = "/var/lib/kubelet/plugins_registry"
PLUGINS_DIR = "/var/lib/kubelet/plugins"
SOCKET = "dra.sock"
TIMEOUT = 10.0      # s one Prepare or Unprepare may take, all its claims together
GRACE = 2.0         # s of it kept for the enforcer's reply after the deadline it is given
MAX_CLAIMS = 4096   # claims of one request handled (a pod names at most a few); the rest: an error each


class Unanswered(ClaimError):
    """The enforcer gave no reply (it may have kept the claims or not)."""


class Enforcer:
    """The enforcer's control socket, as the DRA plugin uses it."""

    def __init__(self, control: str, timeout: float = TIMEOUT):
        self.control, self.timeout = control, timeout

    def _ask(self, msg: dict, timeout: float | None = None) -> dict:
        from ..enforcer.serving.server import request
        try:
            r = request(self.control, msg, self.timeout if timeout is None else max(0.05, timeout))
        except (OSError, ValueError) as e:
            raise Unanswered(f"the enforcer does not answer on {self.control} ({e}); the kubelet asks "
                             "again") from None
        if not r.get("ok"):
            raise ClaimError(str(r.get("error"))[:500])
        return r

    def prepare(self, wires: dict, deadline: float, wait: float) -> dict:
        """{uid: {"changed": bool} or {"error": line}} for the claims of one request; the
        enforcer keeps none it reads after `deadline` (time.monotonic()); waits `wait` s."""
        return self._ask({"cmd": "claim-prepare", "claims": wires, "deadline": deadline}, wait)["claims"]

    def unprepare(self, uids: list, wait: float | None = None) -> bool:
        return self._ask({"cmd": "claim-unprepare", "uids": list(uids)}, wait)["changed"]

    def containers(self, mapping: dict) -> bool:
        return self._ask({"cmd": "claim-containers", "containers": mapping})["changed"]

    def claims(self) -> dict:
        return self._ask({"cmd": "claim-list"})["claims"]


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
        self.timeout = getattr(enforcer, "timeout", TIMEOUT)   # one Prepare's or Unprepare's, all its claims
        self.prepared: dict[str, Claim] = {}   # uid -> the claim as prepared by this process
        self.abandoned: set[str] = set()       # told failed, the enforcer's reply never came: taken back
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
    def read_one(self, uid: str, namespace: str, name: str) -> Claim:
        """The claim read, checked, and its CDI spec written (checked as a runtime checks it)."""
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
        spec = cdi.spec(claim, self.dev_root, self.shim)
        try:
            cdi.validate(spec)
        except cdi.CdiError as e:
            raise ClaimError(f"claim {claim.ref}: its CDI spec would be refused by the runtime: {e}") from None
        if claim.gpus() and not self.cdi_kind and not all(d["containerEdits"].get("deviceNodes") for d in spec["devices"]):
            raise ClaimError(f"claim {claim.ref}: no device node of its GPU under {self.dev_root}, and no CDI kind "
                             "(--cdi) names NVIDIA's spec: its containers would get no GPU")
        self.cdi.write(uid, spec)
        return claim

    def answer(self, claim: Claim, version: str) -> list:
        m, _ = api.dra(version)
        out = []
        for r in claim.results:
            ids = [f"{cdi.KIND}={cdi.name(claim, r)}"] + ([f"{self.cdi_kind}={r.gpu.visible}"] if self.cdi_kind else [])
            extra = {"share_id": r.share_id} if version == "v1" and r.share_id else {}
            out.append(m.Device(request_names=[r.request], pool_name=self.node, device_name=r.device,
                                cdi_device_ids=ids, **extra))
        return out

    def _deadline(self, context) -> float:
        left = self.timeout
        remaining = getattr(context, "time_remaining", lambda: None)() if context is not None else None
        if remaining is not None:
            left = min(left, max(0.5, remaining - 0.5))
        return time.monotonic() + left

    def _requests(self, request) -> tuple[list, dict]:
        """The request's claims, each once, at most MAX_CLAIMS of them; the others' errors."""
        seen, out, past = set(), [], {}
        for c in request.claims:
            if c.uid in seen:
                continue
            seen.add(c.uid)
            if len(out) < MAX_CLAIMS:
                out.append(c)
            else:
                past[c.uid] = f"claim {c.namespace}/{c.name}: more than {MAX_CLAIMS} claims in one request"
        return out, past

    def prepare(self, request, version: str, context=None):
        m, _ = api.dra(version)
        end = self._deadline(context)
        claims, errors = self._requests(request)
        ok: dict[str, Claim] = {}
        locked = self.lock.acquire(timeout=max(0.0, end - time.monotonic()))
        if not locked:
            errors.update({c.uid: "another Prepare or Unprepare of this plugin still waits for the enforcer; the "
                           "kubelet asks again" for c in claims})
            claims = []
        try:
            if locked:
                self._settle(end)
            for c in claims:
                try:
                    if time.monotonic() > end - GRACE:
                        raise ClaimError(f"claim {c.namespace}/{c.name}: not read before this request's deadline")
                    ok[c.uid] = self.read_one(c.uid, c.namespace, c.name)
                except (ClaimError, OSError) as e:
                    errors[c.uid] = str(e)
            errors.update(self._commit(ok, end))
            for uid, e in errors.items():
                if uid in ok and uid not in self.prepared:
                    self.cdi.remove(uid)   # refused: nothing of it stays
                ok.pop(uid, None)
            self.prepared.update(ok)
        finally:
            if locked:
                self.lock.release()
        for uid, claim in ok.items():
            log.info("claim %s (%s) prepared: %s", claim.ref, uid, ", ".join(
                "adminAccess" if r.admin else f"{r.bytes >> 20} MiB on {r.gpu.key}" for r in claim.results))
        for uid, e in errors.items():
            log.warning("claim %s not prepared: %s", uid, e)
        out = {uid: m.NodePrepareResourceResponse(devices=self.answer(c, version)) for uid, c in ok.items()}
        out.update({uid: m.NodePrepareResourceResponse(error=str(e)) for uid, e in errors.items()})
        return m.NodePrepareResourcesResponse(claims=out)

    def _commit(self, ok: dict, end: float) -> dict:
        """The enforcer's decision on the claims that hold memory, in one call: {uid: error}.
        Where it gave no reply, those not prepared before are taken back later (settle)."""
        wires = {uid: c.wire() for uid, c in ok.items() if c.gpus()}
        if not wires:
            return {}
        try:
            got = self.enforcer.prepare(wires, end - GRACE, end - time.monotonic())
        except ClaimError as e:
            if isinstance(e, Unanswered):
                self.abandoned |= set(wires) - set(self.prepared)
            return {uid: str(e) for uid in wires}
        self.abandoned -= set(wires)
        return {uid: str(a.get("error") if isinstance(a, dict) else a)[:500]
                for uid, a in ((u, got.get(u, {"error": "the enforcer did not answer for it"})) for u in wires)
                if not (isinstance(a, dict) and "changed" in a)}

    def _settle(self, end: float | None = None):
        """Claims the kubelet was told had failed, whose reply never came: the enforcer may have
        kept them, so they are ended, unless prepared since. Under the lock."""
        gone = sorted(self.abandoned - set(self.prepared))
        if not gone:
            self.abandoned.clear()
            return
        try:
            self.enforcer.unprepare(gone, None if end is None else min(self.timeout, end - time.monotonic()) - GRACE)
        except ClaimError as e:
            log.warning("claims told failed not taken back yet (%s): %s", ", ".join(gone[:8]), e)
            return
        for uid in gone:
            self.cdi.remove(uid)
        self.abandoned.clear()
        log.info("claims the kubelet was told had failed, taken back: %s", ", ".join(gone[:8]))

    def settle(self):
        """The agent's round (kube/drasync.py): abandoned claims taken back without a request."""
        if self.abandoned and self.lock.acquire(timeout=0):
            try:
                self._settle()
            finally:
                self.lock.release()

    def unprepare(self, request, version: str, context=None):
        m, _ = api.dra(version)
        end = self._deadline(context)
        claims, errors = self._requests(request)
        uids = []
        for c in claims:
            try:
                check_request(c.uid, c.namespace, c.name)
                uids.append(c.uid)
            except ClaimError as e:
                errors[c.uid] = str(e)
        if uids and not self.lock.acquire(timeout=max(0.0, end - time.monotonic())):
            errors.update({u: "another Prepare or Unprepare of this plugin still waits for the enforcer" for u in uids})
            uids = []
        elif uids:
            try:
                self.enforcer.unprepare(uids, end - time.monotonic())
                for uid in uids:
                    self.cdi.remove(uid)
                    self.prepared.pop(uid, None)
                    self.abandoned.discard(uid)
                log.info("claims unprepared: %s", ", ".join(uids[:8]) + (" ..." if len(uids) > 8 else ""))
            except (ClaimError, OSError) as e:
                errors.update({uid: str(e) for uid in uids})
                uids = []
            finally:
                self.lock.release()
        out = {uid: m.NodeUnprepareResourceResponse() for uid in uids}
        out.update({uid: m.NodeUnprepareResourceResponse(error=str(e)) for uid, e in errors.items()})
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
            "NodePrepareResources": lambda self, request, context, v=v: p.prepare(request, v, context),
            "NodeUnprepareResources": lambda self, request, context, v=v: p.unprepare(request, v, context)})()
        out.append(lambda s, ds=ds, servicer=servicer: ds.add_DRAPluginServicer_to_server(servicer, s))
    return out
