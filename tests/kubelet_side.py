"""The kubelet's side of its gRPC APIs, for tests: the Registration service on
<dir>/kubelet.sock (and, as the kubelet does on a Register, a connection back to the plugin:
GetDevicePluginOptions, then ListAndWatch read in a thread) and the PodResourcesLister service
on its own socket. Written from the same .proto files as the agent, speaking the real wire
protocol over UNIX sockets. `restart()` does what a kubelet restart does to the plugin dir: its
socket goes away with every plugin's socket in the dir, and a new kubelet.sock appears.
DraKubelet is the DRA side: plugin registration and the DRAPlugin services (v1, v1beta1)."""
import ctypes
import os
import queue
import select
import struct
import threading
import time
from concurrent import futures

import grpc

from convgpu.kube import api


class Kubelet:
    def __init__(self, plugin_dir: str, pod_resources: str | None = None):
        self.dir = plugin_dir
        self.pod_resources = pod_resources
        self.registrations: "queue.Queue" = queue.Queue()   # RegisterRequest
        self.lists: "queue.Queue" = queue.Queue()           # [(id, health)] per ListAndWatch message
        self.options = None                                 # what GetDevicePluginOptions said
        self.pods = []                                      # v1.PodResources messages List returns
        self.server = None
        self.channel = None
        self._streams = []

    @property
    def socket(self):
        return os.path.join(self.dir, api.KUBELET_SOCKET)

    def start(self):
        dm, ds = api.deviceplugin()
        pm, ps = api.podresources()
        kubelet = self

        class Registration(ds.RegistrationServicer):
            def Register(self, request, context):
                if request.version != api.DEVICE_PLUGIN_VERSION:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unsupported version {request.version}")
                kubelet.registrations.put(request)
                threading.Thread(target=kubelet._watch, args=(request.endpoint,), daemon=True).start()
                return dm.Empty()

        class Lister(ps.PodResourcesListerServicer):
            def List(self, request, context):
                return pm.ListPodResourcesResponse(pod_resources=kubelet.pods)

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        ds.add_RegistrationServicer_to_server(Registration(), self.server)
        self.server.add_insecure_port(api.unix(self.socket))
        if self.pod_resources:
            ps.add_PodResourcesListerServicer_to_server(Lister(), self.server)
            self.server.add_insecure_port(api.unix(self.pod_resources))
        self.server.start()
        return self

    def _watch(self, endpoint):
        dm, ds = api.deviceplugin()
        self.channel = grpc.insecure_channel(api.unix(os.path.join(self.dir, endpoint)))
        stub = ds.DevicePluginStub(self.channel)
        try:
            self.options = stub.GetDevicePluginOptions(dm.Empty(), timeout=5)
            stream = stub.ListAndWatch(dm.Empty())
            self._streams.append(stream)
            for resp in stream:
                self.lists.put([(d.ID, d.health) for d in resp.devices])
        except (grpc.RpcError, ValueError):
            pass   # the plugin or this kubelet went away (ValueError: stop() closed the channel first)

    def plugin(self):
        """A DevicePlugin stub on the plugin's socket (after a registration)."""
        _, ds = api.deviceplugin()
        return ds.DevicePluginStub(self.channel)

    def stop(self):
        for s in self._streams:
            s.cancel()
        if self.channel is not None:
            self.channel.close()
        if self.server is not None:
            self.server.stop(0).wait()

    def restart(self):
        """A kubelet restart: stop, clear the plugin dir's sockets, serve a new kubelet.sock."""
        self.stop()
        for name in os.listdir(self.dir):
            if name.endswith(".sock"):
                os.unlink(os.path.join(self.dir, name))
        fresh = Kubelet(self.dir, self.pod_resources)
        fresh.pods = self.pods
        return fresh.start()


class Node:
    """A GPU node for `convgpu kube` in a subprocess: the stand-in NVML (build/standin-nvml) with
    `gpus` GPUs of `capacity` bytes, and its faults file (tests/standin/libnvidia-ml.c): an XID
    event, a GPU lost to NVML, MIG mode on a GPU."""

    def __init__(self, build, tmp, gpus: int = 2, capacity: int = 4 << 30):
        self.faults = os.path.join(str(tmp), "nvml-faults")
        open(self.faults, "w").close()
        self.env = {"LD_LIBRARY_PATH": os.path.join(str(build), "standin-nvml"), "CONVGPU_STANDIN_GPUS": str(gpus),
                    "CONVGPU_STANDIN_CAPACITY": str(capacity), "CONVGPU_STANDIN_NVML_FAULTS": self.faults}
        self.uuids = [f"GPU-5ca1ab1e-0000-4000-8000-0000000000{i:02x}" for i in range(gpus)]   # the stand-in driver's

    def _add(self, line: str):
        with open(self.faults, "a") as f:
            f.write(line + "\n")

    def xid(self, gpu: int, code: int):
        self._add(f"xid {gpu} {code}")

    def lose(self, gpu: int):
        self._add(f"lost {gpu}")

    def mig(self, gpu: int):
        self._add(f"mig {gpu}")

    def heal(self):
        """Every lost GPU answers again, MIG off; XIDs already delivered stay delivered."""
        with open(self.faults) as f:
            keep = [line for line in f if line.startswith("xid ")]
        with open(self.faults + ".new", "w") as f:
            f.writelines(keep)
        os.replace(self.faults + ".new", self.faults)


# Each DRA call dials anew, as the kubelet's gRPC client does after a plugin restart: gRPC Python
# shares connections to one address between channels, and one that failed while the plugin was
# away (the health stream's reconnect) failed the next call at once with its cached error.
FRESH = [("grpc.use_local_subchannel_pool", 1)]


class Inotify:
    """The kernel's inotify on one directory (inotify(7), through libc): what the kubelet's plugin
    watcher uses (fsnotify). A socket made again at the same path is a new IN_CREATE, whatever its
    inode number (this filesystem gives a new socket the inode of the one unlinked before it)."""

    IN_CREATE, IN_DELETE, IN_MOVED_FROM, IN_MOVED_TO, IN_IGNORED = 0x100, 0x200, 0x40, 0x80, 0x8000
    _HEAD = struct.Struct("iIII")   # struct inotify_event: wd, mask, cookie, len; then the name

    def __init__(self):
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")

    def watch(self, path: str) -> bool:
        mask = self.IN_CREATE | self.IN_DELETE | self.IN_MOVED_FROM | self.IN_MOVED_TO
        return self.libc.inotify_add_watch(self.fd, os.fsencode(path), mask) >= 0

    def events(self, timeout: float) -> list:
        """[(mask, name)] that came within timeout seconds."""
        if not select.select([self.fd], [], [], timeout)[0]:
            return []
        try:
            buf = os.read(self.fd, 65536)
        except BlockingIOError:
            return []
        out, at = [], 0
        while at + self._HEAD.size <= len(buf):
            _, mask, _, n = self._HEAD.unpack_from(buf, at)
            name = buf[at + self._HEAD.size:at + self._HEAD.size + n].rstrip(b"\0").decode()
            out.append((mask, name))
            at += self._HEAD.size + n
        return out

    def close(self):
        os.close(self.fd)


class DraKubelet:
    """The kubelet's side of DRA (issue 40), over the same .proto files as the plugin: it watches
    the plugins_registry dir as the kubelet's plugin watcher does (inotify: a socket created, or
    moved in, is registered; one already there at start too; issue 48: tracked by inode number, a
    plugin restarted on this filesystem was never registered again), registers it (GetInfo, the
    first of the plugin's services it speaks, NotifyRegistrationStatus; retried while the socket
    does not accept yet, as the kubelet's reconciler retries), then calls the chosen DRAPlugin
    service on the plugin's endpoint and reads the health stream (v1alpha1) into `health`.
    `versions`: the services this kubelet speaks (a 1.34 kubelet: v1 and v1beta1). `restart()` is
    a new kubelet on the same dirs: it finds the registration socket again."""

    def __init__(self, registry_dir: str, versions=api.DRA_SERVICES, pod_resources: str | None = None):
        self.dir, self.versions, self.pod_resources = registry_dir, tuple(versions), pod_resources
        self.registrations: "queue.Queue" = queue.Queue()   # (PluginInfo, chosen service or error)
        self.health: "queue.Queue" = queue.Queue()          # [(device, health name)] per message
        self.plugins: dict = {}                             # driver -> (endpoint, chosen version)
        self.pods = []                                      # podresources v1 PodResources
        self.call_timeout = 30.0                            # s a Prepare or Unprepare may take
        self._stop = threading.Event()
        self._channels = []
        self.server = None

    def start(self):
        if self.pod_resources:
            pm, ps = api.podresources()
            kubelet = self

            class Lister(ps.PodResourcesListerServicer):
                def List(self, request, context):
                    return pm.ListPodResourcesResponse(pod_resources=kubelet.pods)
            self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
            ps.add_PodResourcesListerServicer_to_server(Lister(), self.server)
            self.server.add_insecure_port(api.unix(self.pod_resources))
            self.server.start()
        os.makedirs(self.dir, mode=0o755, exist_ok=True)   # the kubelet's own dir (its plugin watcher makes it)
        threading.Thread(target=self._watch, daemon=True).start()
        return self

    def _watch(self):
        notify = Inotify()
        try:
            while not self._stop.is_set():
                while not notify.watch(self.dir):      # the dir was removed: watched again once made
                    if self._stop.wait(0.02):
                        return
                for name in sorted(os.listdir(self.dir)):   # what was there before the watch
                    if name.endswith(".sock"):
                        self._register(os.path.join(self.dir, name))
                gone = False
                while not gone and not self._stop.is_set():
                    for mask, name in notify.events(0.05):
                        gone |= bool(mask & Inotify.IN_IGNORED)
                        if mask & (Inotify.IN_CREATE | Inotify.IN_MOVED_TO) and name.endswith(".sock"):
                            self._register(os.path.join(self.dir, name))
        finally:
            notify.close()

    def _register(self, path):
        rm, rs = api.registration()
        ch = grpc.insecure_channel(api.unix(path), options=FRESH)
        self._channels.append(ch)
        deadline = time.monotonic() + 5
        while True:   # the socket exists from bind(); it accepts from listen()
            try:
                info = rs.RegistrationStub(ch).GetInfo(rm.InfoRequest(), timeout=5)
                break
            except grpc.RpcError as e:
                if time.monotonic() > deadline or self._stop.wait(0.05):
                    self.registrations.put((None, f"GetInfo: {e.code()}"))
                    return
        chosen = next((v for v in info.supported_versions if v in self.versions), None)
        ok = info.type == api.DRA_PLUGIN_TYPE and chosen is not None
        error = "" if ok else f"type {info.type!r}, services {list(info.supported_versions)}: none this kubelet speaks"
        rs.RegistrationStub(ch).NotifyRegistrationStatus(rm.RegistrationStatus(plugin_registered=ok, error=error), timeout=5)
        self.registrations.put((info, chosen or error))
        if ok:
            self.plugins[info.name] = (info.endpoint, chosen.split(".")[0])
            threading.Thread(target=self._read_health, args=(info.endpoint,), daemon=True).start()

    def _read_health(self, endpoint):
        hm, hs = api.drahealth()
        ch = grpc.insecure_channel(api.unix(endpoint), options=FRESH)
        self._channels.append(ch)
        try:
            for resp in hs.DRAResourceHealthStub(ch).NodeWatchResources(hm.NodeWatchResourcesRequest()):
                self.health.put([(d.device.device_name, hm.HealthStatus.Name(d.health)) for d in resp.devices])
        except (grpc.RpcError, ValueError):
            pass   # the plugin or this kubelet went away (ValueError: stop() closed the channel first)

    def _call(self, driver, method, claims):
        endpoint, version = self.plugins[driver]
        m, s = api.dra(version)
        ch = grpc.insecure_channel(api.unix(endpoint), options=FRESH)
        try:
            req = getattr(m, f"{method}Request")(claims=[m.Claim(namespace=ns, uid=uid, name=name) for ns, uid, name in claims])
            return getattr(s.DRAPluginStub(ch), method)(req, timeout=self.call_timeout).claims
        finally:
            ch.close()

    def prepare(self, driver, claims):
        """{uid: NodePrepareResourceResponse} for [(namespace, uid, name)], on the chosen service."""
        return dict(self._call(driver, "NodePrepareResources", claims))

    def unprepare(self, driver, claims):
        return dict(self._call(driver, "NodeUnprepareResources", claims))

    def stop(self):
        self._stop.set()
        for ch in self._channels:
            ch.close()
        if self.server is not None:
            self.server.stop(0).wait()

    def restart(self):
        self.stop()
        fresh = DraKubelet(self.dir, self.versions, self.pod_resources)
        fresh.pods, fresh.call_timeout = self.pods, self.call_timeout
        return fresh.start()
