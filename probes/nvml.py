"""GPU facts from NVML (nvidia-ml-py): names, totals, used memory, and per-process used memory,
which is what lets convgpu *measure* each process's context overhead instead of guessing it."""
import logging
import threading
import time
from dataclasses import dataclass

from ..threads import Thread

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    total: int
    used: int
    uuid: str = ""
    minor: int = -1     # its /dev/nvidiaN (probes/gpumap.py: which GPUs a process opened)
    migs: tuple[str, ...] = ()   # UUIDs of its MIG instances (MIG mode on): charged to this GPU


class Nvml:
    """Thin, failure-tolerant wrapper: `ok` is False when there is no driver or no NVML."""

    def __init__(self):
        self.ok = False
        self.error = ""
        self.compute: set[int] = set()   # pids in the last process_memory()'s compute lists
        self.used: dict[int, int] = {}   # GPU -> its memory in use, as the last process_memory() read it
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
            try:
                minor = int(n.nvmlDeviceGetMinorNumber(h))
            except Exception:
                minor = -1
            out.append(GpuInfo(i, _s(n.nvmlDeviceGetName(h)), mem.total, mem.used, _s(n.nvmlDeviceGetUUID(h)),
                               minor, self._migs(h)))
        return out

    def _migs(self, h) -> tuple[str, ...]:
        """The UUIDs of a GPU's MIG instances, () when MIG is off or unsupported."""
        n = self._n
        try:
            if n.nvmlDeviceGetMigMode(h)[0] != n.NVML_DEVICE_MIG_ENABLE:
                return ()
            out = []
            for j in range(n.nvmlDeviceGetMaxMigDeviceCount(h)):
                try:
                    out.append(_s(n.nvmlDeviceGetUUID(n.nvmlDeviceGetMigDeviceHandleByIndex(h, j))))
                except n.NVMLError:   # an empty slot
                    continue
            return tuple(out)
        except Exception as e:   # NotSupported on cards without MIG
            log.debug("MIG instances: %s", e)
            return ()

    def process_memory(self) -> dict[tuple[int, int], int]:
        """(pid, gpu index) -> bytes NVML says the process uses (allocations + context). Raises
        where the compute processes of a GPU cannot be read (GPU lost, unknown error): an
        empty list there would read as "no process uses it", and every context measured on it
        would fall back to its smaller estimate (issue 31). Graphics processes are optional
        (NotSupported on datacenter cards). A process's compute rows are summed: each copy of
        the driver it loaded is a client of its own, listed apart (two copies in one process:
        two rows, 200 MiB each; the larger alone let 400 MiB pass as 200, issue 47). Its
        graphics rows are summed alike, and are the same memory seen from the other list (a
        process that draws and computes is in both): the larger of the two sums counts."""
        if not self.ok:
            return {}
        n = self._n
        out: dict[tuple[int, int], int] = {}
        compute: set[int] = set()
        totals: dict[int, int] = {}
        for i in range(n.nvmlDeviceGetCount()):
            h = n.nvmlDeviceGetHandleByIndex(i)
            # the GPU's own total, read with its lists: memory no list names (a process gone
            # whose files another keeps) shows here alone (enforcer/attribution.py)
            totals[i] = int(n.nvmlDeviceGetMemoryInfo(h).used)
            rows = list(n.nvmlDeviceGetComputeRunningProcesses(h))
            compute |= {p.pid for p in rows}
            try:
                drawn = _summed(n.nvmlDeviceGetGraphicsRunningProcesses(h))
            except Exception as e:
                log.debug("nvmlDeviceGetGraphicsRunningProcesses: %s", e)
                drawn = {}
            computed = _summed(rows)
            for pid in computed.keys() | drawn.keys():
                out[(pid, i)] = max(computed.get(pid, 0), drawn.get(pid, 0))
        self.compute, self.used = compute, totals   # graphics: listed, not in compute (enforcer/attribution.py)
        return out


def _summed(rows) -> dict[int, int]:
    """pid -> the bytes of its rows in one of NVML's process lists (N/A, a huge value, left out)."""
    out: dict[int, int] = {}
    for p in rows:
        used = p.usedGpuMemory
        if used is not None and used < (1 << 62):
            out[p.pid] = out.get(p.pid, 0) + int(used)
    return out


def _s(x) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


class Sampler:
    """Each process's memory beyond what the probes track (its context, as the driver counts
    it), from process_memory() every `every` s in a thread of its own: on the H100 one sample
    takes milliseconds, which the enforcer's loop would otherwise spend before a pending resume.
    NVML is thread-safe, and ctypes lets go of the GIL during its calls.

    The probes are read around each NVML sample, so the two never come from different moments:
    a sample a second old against bytes read now counted a process's freed gigabytes as its
    context until the next sample, which held its container's waiter for that second. A
    process whose tracked bytes moved, or that had a driver call in flight (an allocation the
    driver may show before it returns), keeps its last value. One transient remains, and it
    reads high: a free the probes settle at its entry while the driver still holds the memory.
    Hence a process's excess is the smaller of its last two clean samples."""

    def __init__(self, nvml: "Nvml", every: float, tracked, busy=lambda: set(), contexts: bool = False):
        self.nvml, self.every, self.tracked, self.busy = nvml, every, tracked, busy
        self.contexts = contexts   # tracked() gives (bytes, contexts): see sample()
        self.ok_at = time.monotonic()   # the last sample NVML answered (stale: ContextCharge._nvml_health)
        self.error = ""                 # why the last sample failed, "" if it did not
        self.raw: dict[tuple[int, int], int] = {}   # NVML's last answer as it was (Cached, the backstop)
        self.seq = 0                                  # answers so far: a new one is looked at once
        self.compute: set[int] | None = None          # pids NVML lists as compute processes
        self.used: dict[int, int] = {}                # GPU -> its memory in use, read with raw
        self._seen: dict[tuple[int, int], int] = {}   # (pid, dev) -> the last clean sample's excess
        self._out: dict[tuple[int, int], int] = {}    # (pid, dev) -> what was given out last
        self._latest: dict | None = None
        self._stop = threading.Event()
        self._thread = Thread(target=self._run, name="convgpu-nvml", daemon=True)

    def start(self) -> "Sampler":
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            try:
                self._latest = self.sample()
                self.compute = getattr(self.nvml, "compute", None)   # None: every pid may compute
                self.used = dict(getattr(self.nvml, "used", {}))
                self.ok_at, self.error = time.monotonic(), ""
                self.seq += 1   # after raw: a reader that sees the count sees its answer
            except Exception as e:   # GPU lost, unknown error: the last sample stays in force
                self.error = f"{type(e).__name__}: {e}"
                log.debug("process_memory: %s", e)
            self._stop.wait(self.every)

    def sample(self) -> dict[tuple[int, int], int]:
        """(pid, dev) -> bytes NVML counts beyond the tracked ones. tracked(): (pid, dev) ->
        the bytes the probes know of (allocations and the per-context charge), or with
        `contexts` (bytes, contexts): then a change of contexts also counts as moving, and each value given out is
        (excess, the contexts it was measured with); the smaller of two samples is taken only
        when both saw the same contexts. busy(): the pids with a driver call in flight. Read in
        this order, any call that overlaps the NVML sample is in flight at one read or moves the
        tracked bytes between them."""
        before = self.tracked()
        moving = self.busy()
        used = self.nvml.process_memory()
        self.raw = used
        moving |= self.busy()
        after = self.tracked()
        out, seen = {}, {}
        none = (0, 0) if self.contexts else 0     # a process the probes never saw
        for k, nbytes in used.items():
            if k[0] in moving or before.get(k, none) != after.get(k, none):
                if k in self._out:
                    out[k] = self._out[k]
                if k in self._seen:
                    seen[k] = self._seen[k]
                continue
            t = after.get(k, none)
            if self.contexts:
                now = max(0, nbytes - t[0])
                last = self._seen.get(k)
                out[k] = (min(now, last[0]) if last and last[1] == t[1] else now, t[1])
                seen[k] = (now, t[1])
                continue
            now = max(0, nbytes - t)
            out[k] = min(now, self._seen.get(k, now))
            seen[k] = now
        self._seen, self._out = seen, out   # processes NVML no longer lists are forgotten
        return out

    def take(self) -> dict | None:
        """The newest sample not taken yet, else None."""
        latest, self._latest = self._latest, None
        return latest

    def close(self):
        self._stop.set()
        self._thread.join(timeout=5)


class Cached:
    """NVML's answers as read at start (the GPUs) and by the sampler (per-process memory), for
    readers in the enforcer's loop (`convgpu trace`'s snapshot): a call that hangs there would
    hold every stall and resume behind it."""
    ok = True

    def __init__(self, gpus: list[GpuInfo], sampler, driver: str = ""):
        self._gpus, self._sampler, self.driver = list(gpus), sampler, driver

    def gpus(self) -> list[GpuInfo]:
        return self._gpus

    def process_memory(self) -> dict[tuple[int, int], int]:
        s = self._sampler()
        return dict(s.raw) if s is not None else {}
