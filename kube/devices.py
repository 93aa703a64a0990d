"""What the device plugin advertises and hands out, as pure functions over plain data (no gRPC,
no /sys): each GPU's shareable memory cut into units of `unit` bytes, one kubelet "device" per
unit; the preferred allocation that keeps a container's units on one GPU; and what a container
gets for its units (the GPU made visible the NVIDIA container toolkit's way, its device nodes)."""
import logging
import os
from collections import defaultdict
from dataclasses import dataclass

from .api import HEALTHY, UNHEALTHY

log = logging.getLogger(__name__)
SEP = "::"     # device id = <gpu key>::<unit number>, the separator NVIDIA's time-slicing uses
UNIT = 256 << 20
RESOURCE = "convgpu.io/gpu-memory"
# Nodes every CUDA process opens besides its GPU's /dev/nvidia<minor> (the toolkit's list).
CONTROL_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset")
# The toolkit's other way to name a container's GPUs, for nodes where it is set to ignore
# NVIDIA_VISIBLE_DEVICES from unprivileged pods (accept-nvidia-visible-devices-envvar-when-
# unprivileged = false, as the GPU operator may set it): /dev/null mounted at this dir/<GPU>.
DEVICE_LIST_DIR = "/var/run/nvidia-container-devices"
# CDI names of the GPUs (nvidia-ctk cdi generate: nvidia.com/gpu=<index|uuid|all>), for runtimes
# that inject GPUs by CDI and ignore NVIDIA_VISIBLE_DEVICES (no `nvidia` runtime class).
CDI_KIND = "nvidia.com/gpu"
# Where a pod finds the preload shim (docs/SHIM.md's paths): the library, read-only, and the
# shim's socket dir, read-only (row 12 of docs/SECURITY.md: a writable mount lets a root tenant
# put its own socket in a neighbour's path).
SHIM_LIB = "/opt/convgpu/libconvgpu.so"
SHIM_DIR = "/run/convgpu/shim"


@dataclass(frozen=True)
class ShimOffer:
    """The host's copies that Allocate mounts into every container with units."""
    lib: str           # the host path of libconvgpu.so (root-owned, outside any container)
    sock_dir: str      # the host path of the enforcer's shim dir (shim.sock)

    def envs(self) -> dict[str, str]:
        return {"LD_PRELOAD": SHIM_LIB, "CONVGPU_SHIM_SOCKET": f"{SHIM_DIR}/shim.sock"}

    def mounts(self) -> list[tuple[str, str]]:
        return [(SHIM_LIB, self.lib), (SHIM_DIR, self.sock_dir)]


@dataclass(frozen=True)
class Gpu:
    index: int
    capacity: int            # bytes shared out on it (--gpu-memory, or NVML's total less --reserve)
    uuid: str = ""           # NVML's "GPU-..." (stable across reboots and re-numbering)
    minor: int | None = None  # /dev/nvidia<minor>; the index when NVML does not say

    @property
    def key(self) -> str:
        return self.uuid or f"gpu{self.index}"

    @property
    def visible(self) -> str:
        """What NVIDIA_VISIBLE_DEVICES names it by: the uuid, else the index."""
        return self.uuid or str(self.index)


def units_of(gpu: Gpu, unit: int) -> int:
    return gpu.capacity // unit


def health(ids: list[str], bad: set[str]) -> list[tuple[str, str]]:
    """[(id, Healthy|Unhealthy)]: the units of a GPU in `bad` (by key) are unhealthy, the rest
    healthy, so one GPU's XID takes only its own units out of the kubelet's count."""
    return [(d, UNHEALTHY if gpu_key(d) in bad else HEALTHY) for d in ids]


def device_ids(gpus: list[Gpu], unit: int) -> list[str]:
    """Every unit of every GPU, in GPU then unit order. Ids are stable for a GPU and capacity,
    which matters: the kubelet checkpoints the ids it allocated and checks them after a restart."""
    return [f"{g.key}{SEP}{n}" for g in gpus for n in range(units_of(g, unit))]


def gpu_key(device_id: str) -> str:
    return device_id.rsplit(SEP, 1)[0]


def _by_gpu(ids) -> dict[str, list[str]]:
    out: dict[str, list[str]] = defaultdict(list)
    for d in ids:
        out[gpu_key(d)].append(d)
    for v in out.values():
        v.sort(key=lambda d: int(d.rsplit(SEP, 1)[1]) if d.rsplit(SEP, 1)[1].isdigit() else 0)
    return out


def preferred(available: list[str], must: list[str], size: int) -> list[str]:
    """`size` ids out of `available`, including `must`, on one GPU whenever one GPU can hold them.

    Among the GPUs that can, the one with the fewest free units wins (best fit: big holes stay
    for big pods, as the scheduler only knows the node's total); ties go to the lower GPU. Only
    when no single GPU has room does the answer span GPUs, the fullest-free first, so that the
    fewest GPUs are touched; Allocate then makes each of them visible."""
    free = _by_gpu(set(available) | set(must))
    pinned = _by_gpu(must)
    if len(pinned) <= 1:
        order = sorted(free, key=lambda k: (len(free[k]), k))
        if pinned:
            order = list(pinned)           # must-include ids fix the GPU
        for k in order:
            if len(free[k]) >= size:
                head = list(pinned.get(k, []))
                rest = [d for d in free[k] if d not in head]
                return head + rest[: size - len(head)]
    out = list(must)
    for k in sorted(free, key=lambda k: (-len(free[k]), k)):
        out += [d for d in free[k] if d not in out][: size - len(out)]
        if len(out) >= size:
            break
    return out[:size]


@dataclass
class Grant:
    """What Allocate gives one container."""
    gpus: list[Gpu]
    units: int
    envs: dict[str, str]
    devices: list[tuple[str, str, str]]    # (container path, host path, permissions)
    mounts: list[tuple[str, str]]           # (container path, host path), read-only
    shares: dict[str, int]                  # gpu key -> bytes of the grant on that GPU
    cdi: list[str]                          # CDI device names of its GPUs


def shares(ids, unit: int) -> dict[str, int]:
    """{gpu key: bytes}: a grant's units counted per GPU. The enforcer limits a container on
    each GPU to that GPU's share, so a grant spread 316 + 84 over two GPUs allows 100 GiB in
    all, as the scheduler counted, not 100 GiB on each (docs/KUBERNETES.md)."""
    return {k: len(v) * unit for k, v in sorted(_by_gpu(ids).items())}


def allocate(ids: list[str], gpus: list[Gpu], unit: int, dev_root: str = "/dev",
             shim: ShimOffer | None = None, cdi_kind: str = CDI_KIND) -> Grant:
    """The container's GPUs made visible (NVIDIA_VISIBLE_DEVICES, read by the NVIDIA container
    toolkit's runtime hook, and the same list as mounts under DEVICE_LIST_DIR) and their device
    nodes (for runtimes without the hook). The limit
    itself is not set here: the container does not exist yet; the agent learns its id from the
    pod-resources API and sets units x unit in the enforcer. Raises KeyError for an unknown id."""
    by_key = {g.key: g for g in gpus}
    known = set(device_ids(gpus, unit))
    for d in ids:
        if d not in known:
            raise KeyError(d)
    used = [by_key[k] for k in sorted(_by_gpu(ids), key=lambda k: by_key[k].index)]
    split = shares(ids, unit)
    if len(used) > 1:
        log.info("%d units span %d GPUs: limited on each to its share (%s)", len(ids), len(used),
                 ", ".join(f"{k} {v >> 20} MiB" for k, v in split.items()))
    envs = {"NVIDIA_VISIBLE_DEVICES": ",".join(g.visible for g in used),
            "CONVGPU_GPU_MEMORY_LIMIT": str(len(ids) * unit)}
    if shim is not None:
        envs.update(shim.envs())
    nodes = [f"/dev/nvidia{g.index if g.minor is None else g.minor}" for g in used] + list(CONTROL_NODES)
    devices = []
    for node in nodes:
        host = os.path.join(dev_root, os.path.basename(node))
        if os.path.exists(host):   # a node the host lacks (no modeset module) is not asked for
            devices.append((node, host, "rw"))
    mounts = [(f"{DEVICE_LIST_DIR}/{g.visible}", "/dev/null") for g in used]
    if shim is not None:
        mounts += shim.mounts()
    return Grant(used, len(ids), envs, devices, mounts, split,
                 [f"{cdi_kind}={g.visible}" for g in used] if cdi_kind else [])
