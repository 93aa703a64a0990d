"""The node agent's loop (`convgpu kube`): the device plugin in its own thread, the GPU inventory
re-read every `inventory_every` seconds (a change reaches the kubelet through ListAndWatch), and
the pods' limits sent to the enforcer every `sync_every` seconds."""
import logging
import threading
import time

from . import devices as dv
from .plugin import DevicePlugin

log = logging.getLogger(__name__)


def inventory(nvml, gpu_memory: int | None, reserve: int) -> list[dv.Gpu]:
    """The GPUs NVML lists, each sharing --gpu-memory or its total less --reserve (what
    `convgpu enforce` shares with the same options). Without NVML, one GPU of --gpu-memory."""
    if not nvml.ok:
        return [dv.Gpu(0, gpu_memory)] if gpu_memory else []
    out = []
    for g in nvml.gpus():
        try:
            minor = nvml._n.nvmlDeviceGetMinorNumber(nvml._n.nvmlDeviceGetHandleByIndex(g.index))
        except Exception:
            minor = None
        cap = gpu_memory if gpu_memory else max(0, g.total - reserve)
        out.append(dv.Gpu(g.index, cap, g.uuid, minor))
    return out


class Agent:
    def __init__(self, plugin: DevicePlugin, sync, read_gpus, sync_every: float = 2.0,
                 inventory_every: float = 30.0):
        self.plugin, self.sync, self.read_gpus = plugin, sync, read_gpus
        self.sync_every, self.inventory_every = sync_every, inventory_every
        self.stop = threading.Event()

    def run(self, duration: float = 0.0, on_step=None):
        t = threading.Thread(target=self.plugin.run, args=(self.stop,), name="device-plugin", daemon=True)
        t.start()
        end = time.monotonic() + duration if duration else None
        next_inv = time.monotonic() + self.inventory_every
        try:
            while not self.stop.is_set() and (end is None or time.monotonic() < end):
                if time.monotonic() >= next_inv:
                    self.plugin.set_gpus(self.read_gpus())
                    next_inv = time.monotonic() + self.inventory_every
                if self.sync is not None:
                    try:
                        self.sync.round()
                    except Exception as e:   # kubelet or enforcer restarting: next round
                        log.warning("pod limits not synced: %s", e)
                if on_step:
                    on_step()
                self.stop.wait(self.sync_every)
        finally:
            self.stop.set()
            t.join(timeout=10)
