"""The kubelet's side of its gRPC APIs, for tests: the Registration service on
<dir>/kubelet.sock (and, as the kubelet does on a Register, a connection back to the plugin:
GetDevicePluginOptions, then ListAndWatch read in a thread) and the PodResourcesLister service
on its own socket. Written from the same .proto files as the agent, speaking the real wire
protocol over UNIX sockets. `restart()` does what a kubelet restart does to the plugin dir: its
socket goes away with every plugin's socket in the dir, and a new kubelet.sock appears."""
import os
import queue
import threading
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
        except grpc.RpcError:
            pass   # the plugin or this kubelet went away

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
        self.uuids = [f"GPU-5374616e-64696e-00000000000{i:x}" for i in range(gpus)]

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
