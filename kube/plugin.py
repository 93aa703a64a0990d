"""The convgpu.io/gpu-memory device plugin: serves the kubelet's DevicePlugin service on a socket
in the device-plugins dir and registers it with the kubelet's Registration service.

The kubelet forgets every plugin when it restarts, and removes the plugins' sockets from its
dir as it starts: `run` watches for our socket going away or kubelet.sock being replaced
(another inode) and then serves again on a fresh socket and registers again."""
import logging
import os
import threading
from collections import deque
from concurrent import futures

from . import api, devices as dv

log = logging.getLogger(__name__)
ENDPOINT = "convgpu.sock"


class _Servicer:
    """The DevicePlugin service over a DevicePlugin's state (made a servicer subclass below,
    once the generated base class is loaded)."""

    def __init__(self, plugin: "DevicePlugin"):
        self.p = plugin

    def GetDevicePluginOptions(self, request, context):
        m, _ = api.deviceplugin()
        return m.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)

    def ListAndWatch(self, request, context):
        """The whole list now, then again each time it changes, until the kubelet hangs up or
        the plugin stops (the kubelet reads a closed stream as "re-register")."""
        m, _ = api.deviceplugin()
        seen = -1
        while context.is_active() and not self.p.stopping:
            with self.p.changed:
                if self.p.version == seen:
                    self.p.changed.wait(timeout=0.5)
                    continue
                seen, ids, bad = self.p.version, list(self.p.ids), set(self.p.bad)
            rows = dv.health(ids, bad)
            log.info("ListAndWatch: %d devices of %s, %d unhealthy", len(rows), self.p.resource,
                     sum(h == api.UNHEALTHY for _, h in rows))
            yield m.ListAndWatchResponse(devices=[m.Device(ID=i, health=h) for i, h in rows])

    def GetPreferredAllocation(self, request, context):
        m, _ = api.deviceplugin()
        out = []
        for r in request.container_requests:
            ids = dv.preferred(list(r.available_deviceIDs), list(r.must_include_deviceIDs), r.allocation_size)
            out.append(m.ContainerPreferredAllocationResponse(deviceIDs=ids))
        return m.PreferredAllocationResponse(container_responses=out)

    def Allocate(self, request, context):
        import grpc
        m, _ = api.deviceplugin()
        out = []
        for r in request.container_requests:
            try:
                g = dv.allocate(list(r.devices_ids), self.p.gpus, self.p.unit, self.p.dev_root,
                                self.p.shim, self.p.cdi_kind)
            except KeyError as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown device {e.args[0]!r} for {self.p.resource}")
            log.info("Allocate: %d units (%d MiB) on GPU %s", g.units, g.units * self.p.unit >> 20,
                     ",".join(str(x.index) for x in g.gpus))
            self.p.grants.append(g)
            out.append(m.ContainerAllocateResponse(
                envs=g.envs, devices=[m.DeviceSpec(container_path=c, host_path=h, permissions=p)
                                      for c, h, p in g.devices],
                mounts=[m.Mount(container_path=c, host_path=h, read_only=True) for c, h in g.mounts],
                cdi_devices=[m.CDIDevice(name=n) for n in g.cdi]))
        return m.AllocateResponse(container_responses=out)

    def PreStartContainer(self, request, context):
        m, _ = api.deviceplugin()
        return m.PreStartContainerResponse()


class Serving:
    """A gRPC server the kubelet dials, kept up by `run` until `stop`: check() (re)serves and
    (re)registers, close() ends it. The subclass has `server` and the Condition `changed` that
    its streams wait on (woken when the server stops)."""

    def run(self, stop: threading.Event, poll: float = 1.0):
        while not stop.is_set():
            self.check()
            stop.wait(poll)
        self.close()

    def _stop_server(self):
        if self.server is not None:
            with self.changed:
                self.changed.notify_all()
            self.server.stop(grace=0.5).wait()
            self.server = None


class DevicePlugin(Serving):
    def __init__(self, plugin_dir: str, gpus: list[dv.Gpu], unit: int = dv.UNIT,
                 resource: str = dv.RESOURCE, endpoint: str = ENDPOINT, dev_root: str = "/dev",
                 shim: dv.ShimOffer | None = None, cdi_kind: str = dv.CDI_KIND):
        self.dir, self.unit, self.resource, self.endpoint, self.dev_root = plugin_dir, unit, resource, endpoint, dev_root
        self.shim, self.cdi_kind = shim, cdi_kind
        self.bad: set[str] = set()   # keys of the GPUs whose units are unhealthy
        self.gpus: list[dv.Gpu] = []
        self.ids: list[str] = []
        self.version = 0
        self.changed = threading.Condition()
        self.stopping = False
        self.server = None
        self.registered = 0          # successful Register calls (doctor, tests)
        self.grants: deque[dv.Grant] = deque(maxlen=256)   # the last Allocate answers (logs, tests)
        self._kubelet_ino = None
        self._failing = False
        self.set_gpus(gpus)

    @property
    def socket(self) -> str:
        return os.path.join(self.dir, self.endpoint)

    @property
    def kubelet_socket(self) -> str:
        return os.path.join(self.dir, api.KUBELET_SOCKET)

    def set_gpus(self, gpus: list[dv.Gpu]) -> bool:
        """New inventory (a GPU gone, another capacity): ListAndWatch sends the new list."""
        ids = dv.device_ids(gpus, self.unit)
        with self.changed:
            self.gpus = list(gpus)
            if ids == self.ids:
                return False
            self.ids = ids
            self.version += 1
            self.changed.notify_all()
        log.info("%s: %d units of %d MiB on %d GPU(s)", self.resource, len(ids), self.unit >> 20, len(gpus))
        return True

    def set_health(self, bad: set[str]) -> bool:
        """The GPUs (by key) now unhealthy: ListAndWatch sends the list again when it changed."""
        with self.changed:
            if set(bad) == self.bad:
                return False
            self.bad = set(bad)
            self.version += 1
            self.changed.notify_all()
        log.warning("%s: unhealthy GPU(s): %s", self.resource, ", ".join(sorted(bad)) or "none")
        return True

    # --- serving and registering ---
    def serve(self):
        import grpc
        _, s = api.deviceplugin()
        self._stop_server()
        try:
            os.unlink(self.socket)
        except FileNotFoundError:
            pass
        servicer = type("DevicePluginServicer", (_Servicer, s.DevicePluginServicer), {})(self)
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        s.add_DevicePluginServicer_to_server(servicer, self.server)
        self.server.add_insecure_port(api.unix(self.socket))
        self.server.start()

    def register(self, timeout: float = 5.0):
        """Register with the kubelet; raises grpc.RpcError when it refuses or is not there."""
        import grpc
        m, s = api.deviceplugin()
        with grpc.insecure_channel(api.unix(self.kubelet_socket)) as ch:
            s.RegistrationStub(ch).Register(m.RegisterRequest(
                version=api.DEVICE_PLUGIN_VERSION, endpoint=self.endpoint, resource_name=self.resource,
                options=m.DevicePluginOptions(get_preferred_allocation_available=True)), timeout=timeout)
        self.registered += 1
        log.info("registered %s with the kubelet (%s)", self.resource, self.kubelet_socket)

    def _ino(self, path):
        try:
            return os.stat(path).st_ino
        except FileNotFoundError:
            return None

    def check(self) -> bool:
        """One round of the watch: serve and register again if the kubelet restarted (our socket
        removed, or kubelet.sock a new file). True when (still) registered."""
        import grpc
        kubelet = self._ino(self.kubelet_socket)
        if kubelet is None:
            return False                    # the kubelet is (re)starting: wait for its socket
        if self.server is None or not os.path.exists(self.socket):
            self.serve()
            self._kubelet_ino = None
        if kubelet != self._kubelet_ino:
            try:
                self.register()
            except grpc.RpcError as e:
                if not self._failing:   # once per outage, not every poll
                    log.warning("registering with the kubelet failed: %s; retrying",
                                e.details() if hasattr(e, "details") else e)
                self._failing = True
                return False
            self._kubelet_ino = kubelet
            self._failing = False
        return True

    def close(self):
        self.stopping = True
        self._stop_server()
