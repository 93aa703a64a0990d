"""GPU facts from NVML (nvidia-ml-py): names, totals, used memory, and per-process used memory,
which is what lets convgpu *measure* each process's context overhead instead of guessing it."""
import logging
import threading
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    total: int
    used: int
    uuid: str = ""


class Nvml:
    """Thin, failure-tolerant wrapper: `ok` is False when there is no driver or no NVML."""

    def __init__(self):
        self.ok = False
        self.error = ""
        try:
            import pynvml
            pynvml.nvmlInit()
            self._n = pynvml
            self.ok = True
            self.driver = _s(pynvml.nvmlSystemGetDriverVersion())
        except Exception as e:  # NVMLError_LibraryNotFound, ImportError, ...
            self.error = str(e) or type(e).__name__
            self.driver = ""

    def close(self):
        if self.ok:
            try:
                self._n.nvmlShutdown()
            except Exception:
                pass
            self.ok = False

    def gpus(self) -> list[GpuInfo]:
        if not self.ok:
            return []
        n = self._n
        out = []
        for i in range(n.nvmlDeviceGetCount()):
            h = n.nvmlDeviceGetHandleByIndex(i)
            mem = n.nvmlDeviceGetMemoryInfo(h)
            out.append(GpuInfo(i, _s(n.nvmlDeviceGetName(h)), mem.total, mem.used, _s(n.nvmlDeviceGetUUID(h))))
        return out

    def process_memory(self) -> dict[tuple[int, int], int]:
        """(pid, gpu index) -> bytes NVML says the process uses (allocations + context)."""
        if not self.ok:
            return {}
        n = self._n
        out: dict[tuple[int, int], int] = {}
        for i in range(n.nvmlDeviceGetCount()):
            h = n.nvmlDeviceGetHandleByIndex(i)
            procs = []
            for fn in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
                try:
                    procs += getattr(n, fn)(h)
                except Exception as e:
                    log.debug("%s: %s", fn, e)
            for p in procs:
                used = p.usedGpuMemory
                if used is not None and used < (1 << 62):   # N/A reads as a huge value
                    out[(p.pid, i)] = max(out.get((p.pid, i), 0), int(used))
        return out


def _s(x) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


class Sampler:
    """process_memory() every `every` s in a thread of its own: on the H100 one sample takes
    milliseconds, which the enforcer's loop would otherwise spend before a pending resume.
    NVML is thread-safe, and ctypes lets go of the GIL during its calls."""

    def __init__(self, nvml: "Nvml", every: float):
        self.nvml, self.every = nvml, every
        self._latest: dict | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nvml-sampler", daemon=True)

    def start(self) -> "Sampler":
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            try:
                self._latest = self.nvml.process_memory()
            except Exception as e:   # a driver hiccup: the next sample may do
                log.debug("process_memory: %s", e)
            self._stop.wait(self.every)

    def take(self) -> dict | None:
        """The newest sample not taken yet, else None."""
        latest, self._latest = self._latest, None
        return latest

    def close(self):
        self._stop.set()
        self._thread.join(timeout=5)
