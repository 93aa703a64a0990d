"""What a CUDA context costs on each GPU before NVML has measured it (issues 14, 31 and 39).

A context takes half a gigabyte on an H100 the moment it exists (FACTS.md: 518-550 MiB per
process), and no allocation call shows it; NVML shows it about a sample later. A container
that allocates its whole assignment in that second has that much more on the card than it was
given, and on a full card that is someone else's out-of-memory error. So every context is
charged an estimate from its first moment, chosen per device, best first:

1. operator: an explicit --ctx-overhead (the operator's word);
2. measured at start: a bare context the enforcer made itself on this GPU model and driver
   (enforcer/ctxmeasure.py), once per model and driver, kept in the state directory, plus a
   margin for what frameworks load into theirs. Newcomers on a GPU whose measurement runs
   wait for it (ContextCharge.hold_newcomer);
3. table hint: the table below, where nothing could be measured (no NVML, MIG, a child that
   failed) and the model and driver are in it;
4. conservative: CONSERVATIVE, where nothing could be measured or is known.

Nothing a tenant's process does moves this figure (issue 39). Before, the estimate was the
median of what NVML had measured for earlier processes: one job whose graph node took 2.5 GiB
beside its 518 MiB context made the next context on that GPU cost 1.5 GiB for everyone, and the
figure was kept across restarts. What a process holds above the estimate is measured by NVML
within a second and charged to its own container (enforcer/overhead.py), and past its limit
the backstop stops it (enforcer/backstop.py): the estimate only has to cover that second.

The *ceiling* (`ceiling`) is a second, higher figure: what the preload shim takes off the
total it reports for each unmeasured context (issue 18, enforcer/serving/memview.py). A
framework reads the total once, early, and sizes itself from it for good, so that figure must
cover a context larger than the estimate (PyTorch with cuBLAS: 612 MiB on the H100)."""
import contextlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass

log = logging.getLogger(__name__)
MiB = 1 << 20
STATE_FILE = "ctx-overhead.json"
DEFAULT_STATE_DIR = "/var/lib/convgpu"

# (GPU name contains, driver major, bytes per context, largest context measured, where). The
# estimate is the top of the measured range of a bare context, not its middle: an estimate too
# high holds a few MiB back for one NVML sample (then the measured value replaces it); one too
# low lets a container past its assignment. The largest is a framework's context with its
# libraries loaded, what the shim's reported total must leave room for (ceiling below).
ARCH_DEFAULTS = (
    ("H100", 580, 550 * MiB, 612 * MiB,
     "H100 80GB HBM3, driver 580.159.04: 518 MiB driver API and nvcc static runtime, 611.9 MiB "
     "PyTorch with cuBLAS loaded (docs/gpu-runs/2026-11-22), 518-550 MiB CuPy and JAX, 522 MiB "
     "PyTorch (docs/gpu-runs/2026-11-23)"),
)
# The last fallback, where nothing was measured or is known: above every per-process context
# measured on these machines (FACTS.md: 518-550 MiB driver API, CuPy, JAX; 612 MiB PyTorch with
# cuBLAS; ~700 MiB PyTorch's cudaMallocAsync; ~966 MiB an NCCL rank on the H200). Too high
# holds memory back until NVML measures the process (a second); too low lets a container past
# its limit, so it errs high.
CONSERVATIVE = 1024 * MiB
# A context measured at start is a bare driver-API one; a framework's is larger (CuPy and JAX
# 518-550 MiB where the bare one is 518 MiB on the H100: 1/16 covers it, and 518 + 1/16 is the
# table's 550 MiB). PyTorch with cuBLAS (612 MiB) is above it for the second before NVML
# measures the process; a larger margin was tried (1/4, 648 MiB) and made a job of a 518 MiB
# context and a 256 MiB block "over" a 900 MiB limit, stopped for good (and killed under
# --over-limit kill) on the H200: a figure too high refuses jobs that fit, one too low is caught
# by the backstop (issue 39) within a second.
MEASURED_MARGIN = 16         # the charge adds 1/MEASURED_MARGIN to the bare context
PAGE = 2 * MiB               # the device's allocation granularity: charges in whole pages
TABLE_ENV = "CONVGPU_CTX_TABLE"   # "off": the table is empty (tests of a model never seen)
# The ceiling's margin over the largest figure known: a context grows as a framework loads more
# kernels (CUDA's lazy loading), and PyTorch with cuBLAS measured 11 % above the architecture
# estimate, 18 % above a bare context. 1/8 of the largest figure, in whole device pages.
CEILING_MARGIN = 8           # the ceiling adds 1/CEILING_MARGIN


@dataclass(frozen=True)
class Device:
    """What NVML tells about a GPU: enough to key a measurement and to find a default."""
    index: int
    name: str = ""
    uuid: str = ""
    driver: str = ""

    @property
    def key(self) -> str:
        """This card and driver."""
        ident = self.uuid or f"GPU{self.index}" + (f" {self.name}" if self.name else "")
        return f"{ident} driver {self.driver}" if self.driver else ident

    @property
    def model_key(self) -> str:
        """A measurement at start belongs to the model and driver (every card of it shares it)."""
        return f"{self.name} driver {self.driver}" if self.name else self.key

    def __str__(self):
        return f"GPU{self.index}" + (f" ({self.name}{' driver ' + self.driver if self.driver else ''})"
                                     if self.name else "")


@dataclass(frozen=True)
class Estimate:
    bytes: int
    source: str      # "operator" | "measured-at-start" | "table-hint" | "conservative"
    detail: str

    def to_json(self) -> dict:
        return {"bytes": self.bytes, "source": self.source, "detail": self.detail}


def driver_major(driver: str) -> int | None:
    try:
        return int(driver.split(".")[0])
    except ValueError:
        return None


def table() -> tuple:
    """ARCH_DEFAULTS, or nothing with CONVGPU_CTX_TABLE=off (a hidden switch for tests: every
    model is then one never seen, the case of a new host's first day)."""
    return () if os.environ.get(TABLE_ENV) == "off" else ARCH_DEFAULTS


def _arch_row(name: str, driver: str) -> tuple | None:
    major = driver_major(driver)
    return next((row for row in table() if row[0] in name and row[1] == major), None)


def arch_default(name: str, driver: str) -> tuple[int, str] | None:
    row = _arch_row(name, driver)
    return (row[2], row[4]) if row else None


def arch_top(name: str, driver: str) -> int | None:
    """The largest context measured on this architecture and driver, if the table knows it."""
    row = _arch_row(name, driver)
    return row[3] if row else None


def measured_charge(bare: int) -> int:
    """What a context is charged where a bare one measured `bare` bytes: 1/16 more, in pages."""
    return -(-(bare + bare // MEASURED_MARGIN) // PAGE) * PAGE


def choose(dev: Device, operator: int | None = None, measured: int | None = None, why: str = "") -> Estimate:
    """The estimate in force for a device's next context. operator: --ctx-overhead if given;
    measured: the bare context measured at start on this model and driver; why: why nothing
    is measured (yet), said with the fallback."""
    if operator is not None:
        return Estimate(operator, "operator", f"--ctx-overhead (the operator's figure on {dev})")
    if measured is not None:
        return Estimate(measured_charge(measured), "measured-at-start",
                        f"a bare context measured {measured} bytes on {dev.model_key}, + 1/{MEASURED_MARGIN}")
    why = f" ({why})" if why else ""
    found = arch_default(dev.name, dev.driver)
    if found:
        return Estimate(found[0], "table-hint", f"nothing measured{why}: the table's {found[1]}")
    return Estimate(CONSERVATIVE, "conservative", f"nothing measured{why} or known for {dev}: above every "
                    "context measured (an NCCL rank ~966 MiB on the H200)")


def below_context(limit: int, estimates: dict[int, Estimate]) -> dict[int, Estimate]:
    """The GPUs on which `limit` is below what one context is charged before NVML measures it
    (issue 52): a process limited so cannot make its context there, and its first CUDA call
    waits until the limit is raised. Where the estimate is the conservative 1 GiB, NVML's
    measurement (within a second of the context) would often fit, but a process that waits at
    its first call has made no context to measure."""
    return {d: e for d, e in sorted(estimates.items()) if limit < e.bytes}


def below_context_text(what: str, limit: int, below: dict[int, Estimate]) -> str:
    """One line: the limit, and each GPU's context charge with where that figure comes from."""
    from ..units import format_size
    gpus = "; ".join(f"GPU{d}: {format_size(e.bytes)} ({e.source}: {e.detail})" for d, e in below.items())
    return f"{what} ({format_size(limit)}) is below one CUDA context's charge on {gpus}"


def ceiling(dev: Device, est: Estimate, page: int) -> Estimate:
    """What the shim's reported total leaves for each context NVML has not measured (issue 18):
    the larger of the estimate in force and the architecture table's largest context, plus
    1/8, rounded up to whole pages (`page`). Only --ctx-overhead is taken as it is: the
    operator's figure, nothing known beside it. Never below the estimate, so a reported total
    never promises what admission would refuse."""
    if est.source == "operator":
        return Estimate(est.bytes, "operator", "--ctx-overhead (no margin: the operator's figure)")
    figures = {"estimate": est.bytes}
    top = arch_top(dev.name, dev.driver)
    if top is not None:
        figures["architecture top"] = top
    name, base = max(figures.items(), key=lambda kv: kv[1])
    nbytes = -(-(base + base // CEILING_MARGIN) // page) * page
    return Estimate(nbytes, name, f"{name} {base} bytes + 1/{CEILING_MARGIN}, in {page}-byte pages "
                    f"(the estimate: {est.source})")


def devices(capacity, gpus: dict, driver: str) -> dict[int, Device]:
    """Each GPU's model and driver as NVML tells them (gpus: index -> probes.nvml.GpuInfo, read
    once at start): the keys of what is measured."""
    return {d: Device(d, gpus[d].name, gpus[d].uuid, driver) if d in gpus else Device(d) for d in capacity}


class Charges:
    """What a context is charged: per GPU the estimate in force (choose) until NVML has measured
    a process, and per process what NVML measured (excess). The books, the control map and the
    shim's view read it; only ContextCharge (enforcer/overhead.py) changes it.
    devices: GPU -> Device; operator: --ctx-overhead or None; measured: the state dir's store."""

    def __init__(self, devices: dict[int, Device], operator: int | None, measured: "MeasuredStore"):
        self.devices, self.operator, self.measured = devices, operator, measured
        self.unmeasured: dict[str, str] = {}   # model key -> why no context is measured there (yet)
        self.waiting: set[int] = set()          # GPUs whose context is being measured: newcomers wait
        # (pid, dev) -> (NVML less its tracked bytes, the contexts it had then): its measured overhead
        self.excess: dict[tuple[int, int], tuple[int, int]] = {}
        self.est = {d: self.choose(d) for d in devices}

    def choose(self, dev: int) -> Estimate:
        d = self.devices[dev]
        return choose(d, self.operator, self.measured.measured_at_start(d.model_key),
                      self.unmeasured.get(d.model_key, ""))

    def estimate(self, dev: int) -> Estimate:
        e = self.est.get(dev)
        return e if e is not None else choose(Device(dev), self.operator)

    def ctx(self, dev: int) -> int:
        """Bytes charged per context on dev until NVML measures it."""
        return self.estimate(dev).bytes

    def newcomer_charge(self) -> int:
        """What a context of a process not placed yet reserves (control.ctx_overhead): the largest
        estimate, but none of a GPU whose context is being measured (its newcomers wait)."""
        return max((e.bytes for d, e in self.est.items() if d not in self.waiting), default=0)


class MeasuredStore:
    """The bare context measured at start per model key, and each model's resident threads
    (enforcer/devattrs.py), in <state dir>/ctx-overhead.json: {"version": 2, "measured": {model
    key: bytes}, "resident": {model key: threads}}. A version-1 file's "devices" (figures
    learned from tenants' processes, which issue 39 stopped using) is read past, once said. No
    directory: kept in memory only. A file that cannot be read is one warning and a fresh
    start (and is replaced at the next save)."""

    def __init__(self, state_dir: str | None):
        self.path = os.path.join(state_dir, STATE_FILE) if state_dir else None
        self.measured: dict[str, int] = {}
        self.resident: dict[str, int] = {}
        self.dirty = False
        if self.path:
            self.measured = self._load()

    def _load(self) -> dict[str, int]:
        try:
            with open(self.path) as f:
                doc = json.load(f)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            log.warning("ignoring %s (%s): context estimates start from defaults", self.path, e)
            return {}
        measured = doc.get("measured", {}) if isinstance(doc, dict) else None
        resident = doc.get("resident", {}) if isinstance(doc, dict) else None
        if not (isinstance(measured, dict) and all(_size(v) for v in measured.values())
                and isinstance(resident, dict) and all(_size(v) for v in resident.values())):
            log.warning("ignoring %s (not a convgpu context file): context estimates start from "
                        "defaults", self.path)
            return {}
        if doc.get("devices"):
            log.info("%s: figures learned from earlier processes are not used (one tenant could move "
                     "them); contexts are charged what the enforcer measured itself", self.path)
            self.dirty = True   # written again without them
        self.resident = dict(resident)
        return dict(measured)

    def measured_at_start(self, model_key: str) -> int | None:
        return self.measured.get(model_key)

    def set_measured(self, model_key: str, nbytes: int):
        self.measured[model_key] = int(nbytes)
        self.dirty = True

    def set_resident(self, model_key: str, threads: int):
        self.resident[model_key] = int(threads)
        self.dirty = True

    def save(self):
        """Atomically (write, fsync, then rename); a failure is one warning, the values stay in
        memory (and are written again at the next change)."""
        if not self.path or not self.dirty:
            return
        self.dirty = False
        d, tmp = os.path.dirname(self.path), None
        try:
            os.makedirs(d, mode=0o755, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".ctx-", dir=d)
            with os.fdopen(fd, "w") as f:
                json.dump({"version": 2, "measured": self.measured, **({"resident": self.resident} if self.resident else {})},
                          f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except OSError as e:   # a full or read-only disk: no half-written file stays behind
            log.warning("cannot save context estimates to %s: %s", self.path, e)
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)


def _size(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0
