"""The node's GPUs as NVML sees them, GPU by GPU: what the device plugin advertises and which
GPUs' units are unhealthy. One GPU's error (an NVML call failing for it, or a critical XID
event) marks only that GPU's units, and they come back once it answers again and no XID came
for `recover_after` seconds; an error of NVML as a whole keeps the last inventory. GPUs in MIG
mode are left out: their memory belongs to MIG instances that the NVIDIA device plugin
advertises, and convgpu's units on the whole card would hand out the same memory twice."""
import ctypes
import logging
import threading
import time

from . import devices as dv

log = logging.getLogger(__name__)
# XIDs an application causes (bad address, a kernel it killed, ...): the GPU is fine. NVIDIA's
# device plugin skips the same ones (its DP_DISABLE_HEALTHCHECKS default list).
APP_XIDS = frozenset({13, 31, 43, 45, 68, 109})
XID_CRITICAL = 0x8        # nvmlEventTypeXidCriticalError
DBE_ECC = 0x4             # nvmlEventTypeDoubleBitEccError


def _s(x) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def _arch(n, h) -> str:
    """The GPU's architecture by NVML's name for it (Hopper, Ampere, ...); "" when unknown."""
    try:
        code = n.nvmlDeviceGetArchitecture(h)
    except Exception:    # an older driver or NVML: not known
        return ""
    names = {getattr(n, k): k.removeprefix("NVML_DEVICE_ARCH_") for k in dir(n) if k.startswith("NVML_DEVICE_ARCH_")}
    name = names.get(code, "")
    return "" if name in ("", "UNKNOWN") else name.capitalize()


class NodeGpus:
    def __init__(self, nvml, gpu_memory: int | None, reserve: int, recover_after: float = 60.0,
                 clock=time.monotonic):
        self.nvml, self.gpu_memory, self.reserve = nvml, gpu_memory, reserve
        self.recover_after, self.clock = recover_after, clock
        self.last: dict[int, dv.Gpu] = {}        # index -> the GPU as last read well
        self.failing: set[str] = set()            # keys whose NVML calls failed at the last read
        self.xid_at: dict[str, float] = {}        # key -> when its last critical XID came
        self.mig: set[str] = set()                # keys left out for MIG mode (logged once)
        self._handles: dict[int, str] = {}        # device handle's address -> key (XID events)
        self.facts: dict[str, dict] = {}          # key -> model, architecture, driver (ResourceSlice)
        self._events = None

    def read(self) -> list[dv.Gpu]:
        """The GPUs to advertise. Without NVML, one GPU of --gpu-memory."""
        if not self.nvml.ok:
            return [dv.Gpu(0, self.gpu_memory)] if self.gpu_memory else []
        n = self.nvml._n
        try:
            count = n.nvmlDeviceGetCount()
        except Exception as e:     # the driver as a whole: keep what was read, all of it suspect
            log.warning("NVML: %s; keeping the last inventory, its GPUs unhealthy", e)
            self.failing = {g.key for g in self.last.values()}
            return sorted(self.last.values(), key=lambda g: g.index)
        out, failing = [], set()
        for i in range(count):
            try:
                h = n.nvmlDeviceGetHandleByIndex(i)
                uuid = _s(n.nvmlDeviceGetUUID(h))
                if self._mig_on(n, h):
                    if uuid not in self.mig:
                        log.warning("GPU %d (%s) is in MIG mode: not shared by convgpu", i, uuid)
                        self.mig.add(uuid)
                    continue
                total = n.nvmlDeviceGetMemoryInfo(h).total
                try:
                    minor = n.nvmlDeviceGetMinorNumber(h)
                except n.NVMLError:
                    minor = None
                cap = self.gpu_memory if self.gpu_memory else max(0, total - self.reserve)
                g = dv.Gpu(i, cap, uuid, minor)
                self.last[i] = g
                self.facts[g.key] = {"model": _s(n.nvmlDeviceGetName(h)), "architecture": _arch(n, h),
                                     "driver": getattr(self.nvml, "driver", "")}
                self._handles[ctypes.cast(h, ctypes.c_void_p).value] = g.key
            except Exception as e:    # this GPU only: its units stay, unhealthy
                g = self.last.get(i)
                if g is None:
                    log.warning("GPU %d: NVML: %s; not advertised until it answers", i, e)
                    continue
                if g.key not in self.failing:
                    log.warning("GPU %d (%s): NVML: %s; its units are unhealthy", i, g.key, e)
                failing.add(g.key)
            out.append(g)
        self.failing = failing
        return out

    @staticmethod
    def _mig_on(n, h) -> bool:
        try:
            return bool(n.nvmlDeviceGetMigMode(h)[0])
        except n.NVMLError:       # not supported (pre-Ampere): no MIG
            return False

    def bad(self) -> set[str]:
        """Keys of the GPUs whose units are unhealthy now."""
        now = self.clock()
        recent = {k for k, at in self.xid_at.items() if now - at < self.recover_after}
        return self.failing | recent

    def on_xid(self, key: str, xid: int) -> bool:
        """An XID on a GPU: True when it makes the GPU unhealthy."""
        if xid in APP_XIDS:
            log.info("GPU %s: XID %d (an application's error): the GPU stays healthy", key, xid)
            return False
        log.warning("GPU %s: XID %d: its units are unhealthy", key, xid)
        self.xid_at[key] = self.clock()
        return True

    def watch(self, stop: threading.Event, changed=lambda: None, wait_ms: int = 1000):
        """XID events of every GPU read so far, until `stop` (a thread of its own: nvmlEventSetWait
        blocks). changed() is called after each event that marks a GPU."""
        if not self.nvml.ok:
            return
        n = self.nvml._n
        try:
            events = n.nvmlEventSetCreate()
        except n.NVMLError as e:
            log.warning("NVML events: %s; GPU health from NVML errors only", e)
            return
        try:
            for g in list(self.last.values()):
                try:
                    n.nvmlDeviceRegisterEvents(n.nvmlDeviceGetHandleByIndex(g.index), XID_CRITICAL | DBE_ECC, events)
                except n.NVMLError as e:
                    log.warning("GPU %s: no XID events (%s)", g.key, e)
            while not stop.is_set():
                try:
                    d = n.nvmlEventSetWait(events, wait_ms)
                except n.NVMLError as e:
                    if not isinstance(e, n.NVMLError_Timeout):
                        log.debug("nvmlEventSetWait: %s", e)
                        stop.wait(wait_ms / 1000)
                    continue
                key = self._handles.get(ctypes.cast(d.device, ctypes.c_void_p).value)
                xid = int(d.eventData) if d.eventType == XID_CRITICAL else 48   # 48: double-bit ECC
                if key is not None and self.on_xid(key, xid):
                    changed()
        finally:
            try:
                n.nvmlEventSetFree(events)
            except n.NVMLError:
                pass
