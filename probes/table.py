"""The one table of probes: which symbol, which BPF functions, required or not, and why.

API ids come from the X-macro list in bpf/convgpu.h (one definition for C and Python)."""
import re
from dataclasses import dataclass

from ..bpf import HEADER

CUDA = "cuda"      # libcuda.so.1: the driver, source of truth
CUDART = "cudart"  # a shared libcudart: only names the runtime call behind a driver call


def _read_apis() -> dict[str, int]:
    text = HEADER.read_text()
    return {name: int(num) for name, num in re.findall(r"X\((\w+),\s*(\d+)\)", text)}


API_IDS: dict[str, int] = _read_apis()
API_NAMES: dict[int, str] = {v: k for k, v in API_IDS.items()}


@dataclass(frozen=True)
class Probe:
    library: str
    symbol: str
    enter: str
    exit: str | None
    required: bool
    why: str
    # a uprobe session program (Linux >= 6.13) that does enter and exit in one, and may skip the
    # return (bpf free_session); where the kernel has no sessions, enter and exit are attached
    session: str | None = None

    @property
    def api(self) -> int:
        return API_IDS[self.symbol]


def _p(lib, sym, exit_fn, required, why, session=False):
    return Probe(lib, sym, f"enter_{sym}", exit_fn, required, why, f"sess_{sym}" if session else None)


PROBES: tuple[Probe, ...] = (
    _p(CUDA, "cuMemAlloc_v2", "exit_alloc", True, "cudaMalloc, PyTorch's default allocator"),
    _p(CUDA, "cuMemFree_v2", "exit_free", True, "frees of cuMemAlloc memory (at return near the limit)", True),
    _p(CUDA, "cuMemAllocPitch_v2", "exit_pitch", False, "pitched 2D allocations"),
    _p(CUDA, "cuMemAllocManaged", "exit_alloc", False, "unified memory"),
    _p(CUDA, "cuMemCreate", "exit_vmm_create", False, "VMM physical memory: expandable segments, NCCL"),
    _p(CUDA, "cuMemRelease", "exit_vmm_release", False, "VMM handle release (bytes go at last unmap)"),
    _p(CUDA, "cuMemMap", "exit_vmm_map", False, "VMM mappings keep released memory alive"),
    _p(CUDA, "cuMemUnmap", "exit_vmm_unmap", False, "VMM unmap frees released handles"),
    _p(CUDA, "cuMemAddressReserve", "exit_va", False, "virtual ranges (shown, not counted)"),
    _p(CUDA, "cuMemAddressFree", "exit_va", False, "virtual ranges (shown, not counted)"),
    _p(CUDA, "cuMemAllocAsync", "exit_alloc", False, "stream-ordered allocator (cudaMallocAsync)"),
    _p(CUDA, "cuMemAllocAsync_ptsz", "exit_alloc", False, "the same, per-thread default stream"),
    _p(CUDA, "cuMemAllocFromPoolAsync", "exit_alloc", False, "memory pools"),
    _p(CUDA, "cuMemAllocFromPoolAsync_ptsz", "exit_alloc", False, "memory pools, per-thread stream"),
    _p(CUDA, "cuMemFreeAsync", "exit_free", False, "stream-ordered frees (at return near the limit)", True),
    _p(CUDA, "cuMemFreeAsync_ptsz", "exit_free", False, "stream-ordered frees, per-thread stream", True),
    _p(CUDA, "cuArrayCreate_v2", "exit_array", False, "CUDA arrays (admitted at entry, size estimated from the descriptor)"),
    _p(CUDA, "cuArray3DCreate_v2", "exit_array", False, "3D arrays (estimated)"),
    _p(CUDA, "cuMipmappedArrayCreate", "exit_array", False, "mipmapped arrays (estimated)"),
    _p(CUDA, "cuArrayDestroy", "exit_array_destroy", False, "array frees"),
    _p(CUDA, "cuMipmappedArrayDestroy", "exit_array_destroy", False, "mipmapped array frees"),
    _p(CUDA, "cuDevicePrimaryCtxRetain", "exit_ctx_create", True, "every runtime process's context"),
    _p(CUDA, "cuDevicePrimaryCtxRelease_v2", "exit_ctx_destroy", False, "primary context release"),
    _p(CUDA, "cuCtxCreate_v2", "exit_ctx_create", False, "driver-API contexts (CUDA 11)"),
    _p(CUDA, "cuCtxCreate_v3", "exit_ctx_create", False, "driver-API contexts (CUDA 12.0)"),
    _p(CUDA, "cuCtxCreate_v4", "exit_ctx_create", False, "driver-API contexts (CUDA >= 12.5)"),
    _p(CUDA, "cuCtxDestroy_v2", "exit_ctx_destroy", False, "driver-API context destroy"),
    _p(CUDA, "cuCtxSetCurrent", None, False, "a thread's device (entry only)"),
    _p(CUDA, "cuCtxPushCurrent_v2", None, False, "a thread's device (entry only)"),
    _p(CUDA, "cuCtxPopCurrent_v2", None, False, "a thread's device (entry only)"),
    _p(CUDA, "cuMemGetInfo_v2", "exit_meminfo", False, "memory queries (shown)"),
    # memory a call takes that is not an allocation (bpf/indirect.bpf.c, issue 39)
    _p(CUDA, "cuCtxSetLimit", "exit_ctx_limit", False, "the stack (per resident thread), heap and printf FIFO"),
    _p(CUDA, "cuGraphAddMemAllocNode", "exit_graph_node", False, "a graph's memory nodes (charged when instantiated)"),
    _p(CUDA, "cuGraphAddNode", "exit_graph_node", False, "graph nodes of any type (memory nodes counted)"),
    _p(CUDA, "cuGraphAddNode_v2", "exit_graph_node", False, "graph nodes with edge data (CUDA >= 12.3)"),
    _p(CUDA, "cuGraphInstantiateWithFlags", "exit_graph_exec", False, "an executable graph takes its memory nodes"),
    _p(CUDA, "cuGraphInstantiateWithParams", "exit_graph_exec", False, "the same, with parameters"),
    _p(CUDA, "cuGraphInstantiateWithParams_ptsz", "exit_graph_exec", False, "the same, per-thread stream"),
    _p(CUDA, "cuGraphInstantiate_v2", "exit_graph_exec", False, "the same, CUDA 11's entry"),
    _p(CUDA, "cuGraphExecDestroy", "exit_graph_gone", False, "an executable graph's memory nodes given back"),
    _p(CUDA, "cuGraphDestroy", "exit_graph_gone", False, "a graph's node count forgotten"),
    _p(CUDA, "cuModuleLoadData", "exit_module", False, "a module's static data, where its image says it"),
    _p(CUDA, "cuModuleLoadDataEx", "exit_module", False, "the same, with JIT options"),
    _p(CUDA, "cuLibraryLoadData", "exit_module", False, "a library's static data (CUDA >= 12)"),
    _p(CUDA, "cuModuleLoad", "exit_module", False, "a module from a file: told, the backstop checks it"),
    _p(CUDA, "cuLibraryLoadFromFile", "exit_module", False, "a library from a file: told, the backstop's"),
    _p(CUDA, "cuModuleUnload", "exit_module_unload", False, "a module's static data given back"),
    _p(CUDA, "cuLibraryUnload", "exit_module_unload", False, "a library's static data given back"),
    _p(CUDART, "cudaMalloc", "exit_runtime", False, "names the runtime call behind the driver's"),
    _p(CUDART, "cudaMallocManaged", "exit_runtime", False, "names the runtime call"),
    _p(CUDART, "cudaMallocPitch", "exit_runtime", False, "names the runtime call"),
    _p(CUDART, "cudaMalloc3D", "exit_runtime", False, "names the runtime call"),
    _p(CUDART, "cudaFree", "exit_runtime", False, "names the runtime call"),
    _p(CUDART, "cudaMemGetInfo", "exit_runtime", False, "memory queries (shown)"),
)

# Calls that take memory that is not an allocation (bpf/indirect.bpf.c): always told in events,
# so that the backstop can name them when a container is over its limit by the driver's count.
INDIRECT = frozenset(p.symbol for p in PROBES if p.exit in (
    "exit_ctx_limit", "exit_graph_node", "exit_graph_exec", "exit_graph_gone", "exit_module",
    "exit_module_unload"))

# Calls that take device memory: admitted at entry (bpf admit_call), and, when enforcing,
# re-checked inside their prologue ("recheck", probes/prologue.py) so that a resume nobody granted is caught
# before the body runs.
ADMITTED = frozenset({
    "cuMemAlloc_v2", "cuMemAllocPitch_v2", "cuMemAllocManaged", "cuMemCreate", "cuMemAllocAsync",
    "cuMemAllocAsync_ptsz", "cuMemAllocFromPoolAsync", "cuMemAllocFromPoolAsync_ptsz",
    "cuArrayCreate_v2", "cuArray3DCreate_v2", "cuMipmappedArrayCreate",   # sized from their descriptor
    "cuDevicePrimaryCtxRetain", "cuCtxCreate_v2", "cuCtxCreate_v3", "cuCtxCreate_v4",
    # memory that is not an allocation, sized at the entry where it can be (bpf/indirect.bpf.c)
    "cuCtxSetLimit", "cuGraphInstantiateWithFlags", "cuGraphInstantiateWithParams",
    "cuGraphInstantiateWithParams_ptsz", "cuGraphInstantiate_v2", "cuModuleLoadData", "cuModuleLoadDataEx",
    "cuLibraryLoadData",
})

# The driver's most used entry points besides those above: while a process is swapped (its GPU
# memory checkpointed to host memory, enforcer/swap/), BPF `touch` (bpf/swap.bpf.c) is attached
# to each the host's drivers export, so that the swapped process's next call is heard (it blocks
# in the driver until restored). Attached only then: a launch pays no trap otherwise.
TOUCH: tuple[str, ...] = tuple(f"{name}{sfx}" for name, sfxs in (
    ("cuLaunchKernel", ("", "_ptsz")), ("cuLaunchKernelEx", ("", "_ptsz")),
    ("cuLaunchCooperativeKernel", ("", "_ptsz")), ("cuGraphLaunch", ("", "_ptsz")),
    ("cuMemcpy", ("", "_ptds")), ("cuMemcpyAsync", ("", "_ptsz")), ("cuMemcpyHtoD_v2", ("", "_ptds")),
    ("cuMemcpyDtoH_v2", ("", "_ptds")), ("cuMemcpyDtoD_v2", ("", "_ptds")), ("cuMemcpyHtoDAsync_v2", ("", "_ptsz")),
    ("cuMemcpyDtoHAsync_v2", ("", "_ptsz")), ("cuMemcpyDtoDAsync_v2", ("", "_ptsz")),
    ("cuMemsetD8_v2", ("", "_ptds")), ("cuMemsetD32_v2", ("", "_ptds")), ("cuMemsetD8Async", ("", "_ptsz")),
    ("cuMemsetD32Async", ("", "_ptsz")), ("cuStreamSynchronize", ("", "_ptsz")), ("cuCtxSynchronize", ("",)),
    ("cuEventSynchronize", ("",)), ("cuEventRecord", ("", "_ptsz")), ("cuStreamWaitEvent", ("", "_ptsz")),
    ("cuStreamQuery", ("", "_ptsz")), ("cuEventQuery", ("",)),
) for sfx in sfxs)
