"""How many threads each GPU keeps resident: what a stack limit costs per byte (issue 39).

`cuCtxSetLimit(CU_LIMIT_STACK_SIZE, n)` makes the driver reserve n bytes of stack for every
thread the device can hold at once: SMs x resident threads per SM. On an H200 (132 SMs x 2,048)
64 KiB took 17,150 MiB, 270,336 x 63 KiB over a 518 MiB context (FACTS.md). BPF charges the
stack at the call's entry (bpf/indirect.bpf.c) from the per-GPU figure written here into its
`resident` map; where it is not known, a figure above every GPU's (fail closed: charged high).

The figure comes from the host's own driver (a library the tracer trusts, never a container's
file), asked by a short child: cuInit, then per device its UUID and two attributes. No
context is made, so the child takes no GPU memory and no admitted call. It runs once per GPU
model and driver: the answer is kept in the state dir with the context measured at start
(ctxest.MeasuredStore), so a restart asks nothing."""
import ctypes as ct
import json
import logging
import os
import subprocess
import sys

log = logging.getLogger(__name__)
TIMEOUT = 10.0   # s: cuInit of a driver with eight GPUs takes a second or two

_CHILD = r"""
import ctypes, json, sys
cu = ctypes.CDLL(sys.argv[1])
n, out = ctypes.c_int(), []
if cu.cuInit(0) or cu.cuDeviceGetCount(ctypes.byref(n)):
    sys.exit(2)
for i in range(n.value):
    d, sms, per, uuid = ctypes.c_int(), ctypes.c_int(), ctypes.c_int(), (ctypes.c_ubyte * 16)()
    if cu.cuDeviceGet(ctypes.byref(d), i) or cu.cuDeviceGetAttribute(ctypes.byref(sms), 16, d) \
            or cu.cuDeviceGetAttribute(ctypes.byref(per), 39, d):
        continue
    u = bytes(uuid).hex() if cu.cuDeviceGetUuid(uuid, d) == 0 else ""
    out.append({"ordinal": i, "uuid": u, "threads": sms.value * per.value})
print(json.dumps(out), flush=True)
"""


def write(b, threads: dict[int, int | None]):
    """Into the loaded program's `resident` map (bpf/indirect.bpf.c); None or 0: unknown."""
    t = b[b"resident"]
    for d, n in threads.items():
        if n and 0 <= d < len(t):
            t[ct.c_int(d)] = ct.c_ulonglong(n)
    log.info("resident threads per GPU (a stack byte costs that many): %s", ", ".join(
        f"GPU{d} {n if n else 'unknown'}" for d, n in sorted(threads.items())))


def host_driver(libraries) -> str | None:
    """The host's own driver among the tracer's libraries (never a container's copy)."""
    from ..probes.table import CUDA
    return next((lib.path for lib in libraries if lib.kind == CUDA and lib.trusted), None)


def _uuid(nvml_uuid: str) -> str:
    """NVML's `GPU-5ca1ab1e-0000-...` as the 32 hex digits cuDeviceGetUuid gives."""
    return nvml_uuid.removeprefix("GPU-").replace("-", "").lower()


def query(lib: str, gpus: list, env: dict | None = None) -> dict[int, int]:
    """Host GPU (NVML index) -> resident threads, from the driver `lib`; {} where it cannot
    be asked. gpus: NVML's GpuInfo rows (their UUIDs tie the driver's ordinals to NVML's
    indexes); none: ordinals in PCI order are the indexes."""
    env = dict(os.environ if env is None else env)
    env.pop("LD_PRELOAD", None)          # the preload shim would ask the enforcer: not here
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    try:
        r = subprocess.run([sys.executable, "-c", _CHILD, lib], capture_output=True, text=True, timeout=TIMEOUT,
                           env=env, cwd="/")
        rows = json.loads(r.stdout) if r.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError) as e:
        log.warning("the GPUs' resident threads could not be read from %s (%s): a stack limit is charged "
                    "for the most threads any GPU has", lib, e)
        return {}
    if not isinstance(rows, list):
        log.warning("the GPUs' resident threads could not be read from %s (exit %s): a stack limit is "
                    "charged for the most threads any GPU has", lib, r.returncode)
        return {}
    by_uuid = {_uuid(g.uuid): g.index for g in gpus if g.uuid}
    out = {}
    for row in rows:
        host = by_uuid.get(row["uuid"]) if by_uuid else row["ordinal"]
        if host is not None and row["threads"] > 0:
            out[host] = int(row["threads"])
    return out
