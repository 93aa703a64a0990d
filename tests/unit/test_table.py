"""The probe table agrees with the BPF source: every entry's functions exist there, every
API the header lists is probed, and the issue's required symbols are present."""
import re

from convgpu.bpf import source_text
from convgpu.probes.table import API_IDS, API_NAMES, CUDA, CUDART, PROBES

SRC = source_text()    # the top file with its parts, as bcc compiles it
DEFINED = set(re.findall(r"^int (\w+)\(struct pt_regs", SRC, re.M))
DEFINED |= {f"enter_{n}" for n in re.findall(r"(?:ENTER|RT|INDIRECT)\((\w+)\)", SRC) if n != "name"}


def test_every_probe_function_exists_in_bpf_source():
    for p in PROBES:
        assert p.enter in DEFINED, p
        assert p.exit is None or p.exit in DEFINED, p


def test_every_api_in_header_is_probed_or_a_tracepoint():
    probed = {p.symbol for p in PROBES}
    assert set(API_IDS) - probed == {"sched_process_exit", "sched_process_exec", "sys_openat"}
    assert len(API_NAMES) == len(API_IDS)


def test_issue_symbols_covered():
    want = """cuMemAlloc_v2 cuMemAllocPitch_v2 cuMemAllocManaged cuMemFree_v2 cuMemCreate cuMemRelease
    cuMemMap cuMemUnmap cuMemAddressReserve cuMemAddressFree cuMemAllocAsync cuMemAllocFromPoolAsync
    cuMemFreeAsync cuMemAllocAsync_ptsz cuMemAllocFromPoolAsync_ptsz cuMemFreeAsync_ptsz
    cuArrayCreate_v2 cuArray3DCreate_v2 cuMipmappedArrayCreate cuArrayDestroy cuMipmappedArrayDestroy
    cuDevicePrimaryCtxRetain cuDevicePrimaryCtxRelease_v2 cuCtxCreate_v2 cuCtxCreate_v3 cuCtxCreate_v4
    cuCtxDestroy_v2 cuCtxSetCurrent cuCtxPushCurrent_v2 cuCtxPopCurrent_v2""".split()
    assert set(want) <= {p.symbol for p in PROBES if p.library == CUDA}
    rt = {"cudaMalloc", "cudaMallocManaged", "cudaMallocPitch", "cudaMalloc3D", "cudaFree", "cudaMemGetInfo"}
    assert rt == {p.symbol for p in PROBES if p.library == CUDART}


def test_only_the_essentials_are_required():
    assert {p.symbol for p in PROBES if p.required} == {"cuMemAlloc_v2", "cuMemFree_v2", "cuDevicePrimaryCtxRetain"}


def test_the_calls_bpf_admits_are_the_ones_the_enforcer_rechecks():
    """bpf admitted() (where an unplaced process may make a thread entry, issue 33) and
    table.ADMITTED (the recheck probes, the shim's marks) name the same calls, and admit_call
    has a case for each."""
    from convgpu.probes.table import ADMITTED
    src = SRC
    body = re.search(r"static __always_inline int admitted\(u16 api\)\n\{(.*?)\n\}", src, re.S).group(1)
    assert set(re.findall(r"API_(\w+)", body)) == set(ADMITTED)
    call = re.search(r"static __always_inline void admit_call\((.*?)\n\}", src, re.S).group(1)
    assert set(ADMITTED) <= set(re.findall(r"case API_(\w+)", call))


def test_every_part_is_included_once_and_none_is_over_700_lines():
    """bpf/ by concern (issue 41): each *.bpf.c part is pasted into the one program exactly once,
    none is left to the preprocessor (its map calls would not load), and each stays readable."""
    from convgpu.bpf import DIR, SOURCE
    parts = sorted(p.name for p in DIR.glob("*.bpf.c") if p != SOURCE)
    assert len(parts) >= 6
    assert sorted(re.findall(r'^#line 1 "(\w+\.bpf\.c)"$', SRC, re.M)) == parts
    assert not re.search(r'^#include "[\w.]+\.bpf\.c"', SRC, re.M)
    assert {p.name: len(p.read_text().splitlines()) for p in DIR.iterdir()
            if p.suffix in (".c", ".h") and len(p.read_text().splitlines()) > 700} == {}
