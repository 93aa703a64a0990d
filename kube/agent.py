"""The node agent's loop (`convgpu kube`): the device plugin in its own thread, the GPUs re-read
every `inventory_every` seconds (a change of inventory or of health reaches the kubelet through
ListAndWatch; kube/health.py), and the pods' limits sent to the enforcer every `sync_every`
seconds. Neither a failing read nor a failing sync ends the loop: the kubelet would otherwise
see the plugin's stream close and take every unit down."""
import logging
import threading
import time

from .plugin import DevicePlugin

log = logging.getLogger(__name__)
MAX_BACKOFF = 60.0   # s between two rounds of limits while they fail


def one_line(e: Exception) -> str:
    """An error as one line: a gRPC error's code and details (its str() is a multi-line dump)."""
    code, details = getattr(e, "code", None), getattr(e, "details", None)
    if callable(code) and callable(details):
        try:
            return f"{code().name}: {details()}"[:300]
        except Exception:
            pass
    text = " ".join(str(e).split())
    return (text or type(e).__name__)[:300]


class Agent:
    def __init__(self, plugin: DevicePlugin, sync, read_gpus, sync_every: float = 2.0,
                 inventory_every: float = 5.0, bad=None, watch=None):
        """read_gpus() -> [Gpu]; bad() -> keys of unhealthy GPUs (after a read); watch(stop,
        changed): a blocking event watcher (XIDs) run in a thread of its own."""
        self.plugin, self.sync, self.read_gpus = plugin, sync, read_gpus
        self.bad, self.watch = bad, watch
        self.sync_every, self.inventory_every = sync_every, inventory_every
        self.stop = threading.Event()
        self._wake = threading.Event()
        self.failing: str | None = None   # why the last round of limits failed (said once)
        self.delay = sync_every

    def _read(self):
        try:
            gpus = self.read_gpus()
            if gpus:
                self.plugin.set_gpus(gpus)
            if self.bad is not None:
                self.plugin.set_health(self.bad())
        except Exception as e:    # NVML or the driver: the last inventory stays
            log.warning("GPU inventory not read: %s", e)

    def run(self, duration: float = 0.0, on_step=None):
        threads = [threading.Thread(target=self.plugin.run, args=(self.stop,), name="device-plugin", daemon=True)]
        if self.watch is not None:
            threads.append(threading.Thread(target=self.watch, args=(self.stop, self._changed),
                                            name="gpu-events", daemon=True))
        for t in threads:
            t.start()
        end = time.monotonic() + duration if duration else None
        next_inv = time.monotonic() + self.inventory_every
        next_sync = 0.0
        try:
            while not self.stop.is_set() and (end is None or time.monotonic() < end):
                now = time.monotonic()
                if now >= next_inv or self._wake.is_set():
                    self._wake.clear()
                    self._read()
                    next_inv = now + self.inventory_every
                if self.sync is not None and now >= next_sync:
                    next_sync = now + self._sync_round()
                if on_step:
                    on_step()
                self._wake.wait(min(self.sync_every, self.inventory_every, 0.5))
        finally:
            self.stop.set()
            for t in threads:
                t.join(timeout=10)

    def _sync_round(self) -> float:
        """One round of the pods' limits; seconds until the next. A failure is one line, said
        again only when its reason changes, and the rounds back off to MAX_BACKOFF until one
        succeeds (issue 52: on a host with no kubelet, a multi-line gRPC error every 2 s)."""
        try:
            self.sync.round()
        except Exception as e:   # kubelet or enforcer restarting (or absent): next round
            why = one_line(e)
            if why != self.failing:
                log.warning("limits not synced: %s; trying again, less often while it fails (up to every %.0f s)",
                            why, MAX_BACKOFF)
            self.failing, self.delay = why, min(max(self.delay, self.sync_every) * 2, MAX_BACKOFF)
            return self.delay
        if self.failing is not None:
            log.info("limits synced again")
        self.failing, self.delay = None, self.sync_every
        return self.sync_every

    def _changed(self):
        self._wake.set()


def offer_shim(run_dir: str, host_run_dir: str | None = None):
    """Say what Allocate mounts, both read-only (kube/devices.py): the enforcer's copy of the
    package's libconvgpu.so in the host's run dir (root's, outside any container; the same file
    the enforcer marks as the shim's: paths.offered_shim) and the enforcer's shim dir."""
    import os

    from ..paths import offered_shim
    from . import devices as dv
    from ..cli.shim import library
    library()   # not built: the one-line error says how to build it
    offered_shim(run_dir)
    host = host_run_dir or run_dir
    return dv.ShimOffer(os.path.join(host, "lib", "libconvgpu.so"), os.path.join(host, "shim"))
