"""Issue 39, part 5: the stand-in driver's memory outside cuMemAlloc & co, the bytes it puts
in the per-process slots (what the tests read as NVML's per-process memory): cuCtxSetLimit's
stack, heap and printf FIFO; graph memory nodes, explicit and captured, and the graph memory
pool (reserved vs live, trim); modules and libraries of the stand-in's image. Also cuda_min.h
against CUDA 13.0's cuda.h: every layout, value and prototype.

Each scenario runs in a child process of its own (this file run as a script, the stand-in
loaded with ctypes, a shared segment of its own): its device memory is then the driver's whole
count (cuMemGetInfo), and every step is seen. No root, no probes: only the build."""
import ast
import ctypes
import json
import os
import re
import shutil
import struct
import subprocess
import sys
from ctypes import byref, c_size_t, c_uint64, c_void_p
from pathlib import Path

import pytest

pytestmark = pytest.mark.system
MiB, GiB = 1 << 20, 1 << 30
CUDA_INCLUDE = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "include"
CUDA_MIN = Path(__file__).resolve().parents[1] / "standin" / "cuda_min.h"
STACK, FIFO, HEAP = 0, 1, 2                     # CUlimit
PER_THREAD = c_void_p(2)                        # CU_STREAM_PER_THREAD
ALLOC, FREE, KERNEL = 10, 11, 0                 # CUgraphNodeType


# ----------------------------------------------------------------- the child's side


class Cu:
    """The stand-in through ctypes: cu.NAME(*args) is the call's CUresult."""

    def __init__(self, path: str):
        self.lib = ctypes.CDLL(path)
        assert self.lib.cuInit(0) == 0

    def __getattr__(self, name):
        return getattr(self.lib, name)

    def used(self) -> int:
        """The device's bytes in use: this process's, the segment being its own."""
        free, total = c_size_t(), c_size_t()
        if self.lib.cuMemGetInfo_v2(byref(free), byref(total)) != 0:
            return self.slot()      # no context current (or it is destroyed): the slot itself
        return total.value - free.value

    def slot(self) -> int:
        with open(f"/dev/shm/{os.environ['CONVGPU_STANDIN_SHM'].lstrip('/')}", "rb") as f:
            seg = f.read()
        hiwater, = struct.unpack_from("<I", seg, 20)
        return sum(struct.unpack_from("<Q", seg, 352 + 144 * i + 16)[0] for i in range(hiwater)
                   if struct.unpack_from("<i", seg, 352 + 144 * i)[0] == os.getpid())

    def primary(self):
        ctx = c_void_p()
        assert self.lib.cuDevicePrimaryCtxRetain(byref(ctx), 0) == 0
        assert self.lib.cuCtxSetCurrent(ctx) == 0

    def limit(self, which: int):
        v = c_size_t()
        rc = self.lib.cuCtxGetLimit(byref(v), which)
        return v.value if rc == 0 else f"rc {rc}"

    def attrs(self) -> list[int]:
        """cuDeviceGetGraphMemAttribute: used, used high, reserved, reserved high."""
        out = []
        for a in range(4):
            v = c_uint64()
            assert self.lib.cuDeviceGetGraphMemAttribute(0, a, byref(v)) == 0
            out.append(v.value)
        return out

    def graph(self):
        g = c_void_p()
        assert self.lib.cuGraphCreate(byref(g), 0) == 0
        return g

    def alloc_node(self, g, nbytes: int, deps=None):
        """cuGraphAddMemAllocNode with the layout the H200 run read: (CUresult, node, dptr)."""
        p = alloc_params(nbytes)
        node = c_void_p()
        nd = len(deps or [])
        arr = (c_void_p * max(nd, 1))(*(deps or []))
        rc = self.lib.cuGraphAddMemAllocNode(byref(node), g, arr if nd else None, c_size_t(nd), p)
        return rc, node, struct.unpack_from("<Q", p, 112)[0]

    def free_node(self, g, dptr: int, deps=None):
        node = c_void_p()
        nd = len(deps or [])
        arr = (c_void_p * max(nd, 1))(*(deps or []))
        return self.lib.cuGraphAddMemFreeNode(byref(node), g, arr if nd else None, c_size_t(nd), c_uint64(dptr))

    def instantiate(self, g, flags: int = 0):
        x = c_void_p()
        return self.lib.cuGraphInstantiateWithFlags(byref(x), g, ctypes.c_ulonglong(flags)), x


def alloc_params(nbytes: int):
    """CUDA_MEM_ALLOC_NODE_PARAMS: poolProps (88 bytes: allocType PINNED, location DEVICE 0),
    accessDescs 88, accessDescCount 96, bytesize 104, dptr 112."""
    p = ctypes.create_string_buffer(120)
    struct.pack_into("<iiii", p, 0, 1, 0, 1, 0)
    struct.pack_into("<Q", p, 104, nbytes)
    return p


def node_params(kind: int, value: int):
    """CUgraphNodeParams (256 bytes): type at 0, the union at 16: an alloc's bytesize at
    16 + 104 (its dptr comes back at 16 + 112), a free's dptr at 16."""
    p = ctypes.create_string_buffer(256)
    struct.pack_into("<i", p, 0, kind)
    if kind == ALLOC:
        struct.pack_into("<iiii", p, 16, 1, 0, 1, 0)
        struct.pack_into("<Q", p, 16 + 104, value)
    else:
        struct.pack_into("<Q", p, 16, value)
    return p


def scenario_limits(cu: Cu) -> dict:
    o = {"no_context": cu.cuCtxSetLimit(STACK, c_size_t(64 << 10))}
    cu.primary()
    o["defaults"] = [cu.limit(STACK), cu.limit(FIFO), cu.limit(HEAP)]
    steps = [("stack_64k", STACK, 64 << 10), ("stack_32k", STACK, 32 << 10), ("heap_72m", HEAP, 72 * MiB),
             ("heap_40m", HEAP, 40 * MiB), ("fifo_2m", FIFO, 2 * MiB)]
    for name, which, value in steps:
        o[name] = [cu.cuCtxSetLimit(which, c_size_t(value)), cu.limit(which), cu.used()]
    o["other_limit"] = [cu.cuCtxSetLimit(5, c_size_t(32)), cu.limit(5)]
    o["released"] = [cu.cuDevicePrimaryCtxRelease_v2(0), cu.limit(STACK), cu.used()]
    cu.primary()
    o["retained_again"] = [cu.limit(STACK), cu.limit(FIFO), cu.limit(HEAP), cu.used()]
    ctx = c_void_p()
    assert cu.cuCtxCreate_v2(byref(ctx), 0, 0) == 0
    o["created"] = [cu.cuCtxSetLimit(STACK, c_size_t(64 << 10)), cu.used(), cu.cuCtxDestroy_v2(ctx), cu.used()]
    return o


def scenario_graph(cu: Cu) -> dict:
    cu.primary()
    g = cu.graph()
    rc, node, d = cu.alloc_node(g, 8 * MiB)
    o = {"added": [rc, d != 0, cu.used()]}
    rc, x = cu.instantiate(g)
    o["instantiated"] = [rc, cu.used()]
    o["second_exec"] = cu.instantiate(g)[0]
    o["launched"] = [cu.cuGraphLaunch(x, None), cu.used(), cu.attrs()]
    o["relaunch_unfreed"] = [cu.cuGraphLaunch(x, None), cu.used()]
    o["memset"] = [cu.cuMemsetD8_v2(c_uint64(d), 0, c_size_t(n)) for n in (8 * MiB, 8 * MiB + 1)]
    o["freed"] = [cu.cuMemFree_v2(c_uint64(d)), cu.used(), cu.attrs()]
    o["freed_again"] = [cu.cuMemFree_v2(c_uint64(d)), cu.cuMemsetD8_v2(c_uint64(d), 0, c_size_t(1))]
    o["relaunched"] = [cu.cuGraphLaunch(x, None), cu.used(), cu.attrs()]
    o["exec_destroyed"] = [cu.cuGraphExecDestroy(x), cu.used(), cu.attrs()]
    o["graph_destroyed"] = [cu.cuGraphDestroy(g), cu.used()]
    o["trim_while_live"] = [cu.cuDeviceGraphMemTrim(0), cu.used()]
    o["freed_at_last"] = [cu.cuMemFree_v2(c_uint64(d)), cu.used(), cu.attrs()]
    o["trimmed"] = [cu.cuDeviceGraphMemTrim(0), cu.used(), cu.attrs()]
    return o


def scenario_graph_oom(cu: Cu) -> dict:
    """Capacity 16 MiB: 10 MiB allocated, a graph of 8 MiB."""
    cu.primary()
    lin = c_uint64()
    assert cu.cuMemAlloc_v2(byref(lin), c_size_t(10 * MiB)) == 0
    g = cu.graph()
    assert cu.alloc_node(g, 8 * MiB)[0] == 0
    rc, x = cu.instantiate(g)
    o = {"instantiated": [rc, cu.used(), cu.attrs()]}
    if rc == 0:
        o["launched"] = [cu.cuGraphLaunch(x, None), cu.used(), cu.attrs()]
    assert cu.cuMemFree_v2(lin) == 0
    if rc != 0:
        rc, x = cu.instantiate(g)
        o["instantiated_with_room"] = [rc, cu.used()]
    o["launched_with_room"] = [cu.cuGraphLaunch(x, None), cu.used()]
    return o


def scenario_graph_nodes(cu: Cu) -> dict:
    cu.primary()
    g = cu.graph()
    rc, a_node, a = cu.alloc_node(g, 4 * MiB)
    o = {"free_node": cu.free_node(g, a, [a_node.value]),
         "free_node_twice": cu.free_node(g, a),
         "free_node_not_graph_memory": cu.free_node(g, 0x1234),
         "free_node_foreign_dependency": cu.free_node(g, a, [0x1234]),
         "free_node_other_graph": cu.free_node(cu.graph(), a)}
    p = node_params(ALLOC, 2 * MiB)
    node = c_void_p()
    rc = cu.cuGraphAddNode_v2(byref(node), g, None, None, c_size_t(0), p)
    b = struct.unpack_from("<Q", p, 16 + 112)[0]
    o["add_node_v2_alloc"] = [rc, b != 0 and b != a]
    o["add_node_v1_free"] = cu.cuGraphAddNode(byref(node), g, None, c_size_t(0), node_params(FREE, b))
    o["add_node_kernel"] = cu.cuGraphAddNode(byref(node), g, None, c_size_t(0), node_params(KERNEL, 0))
    rc, x = cu.instantiate(g, 1)        # AUTO_FREE_ON_LAUNCH
    o["launched"] = [rc, cu.cuGraphLaunch(x, None), cu.used(), cu.attrs()]
    o["relaunched"] = [cu.cuGraphLaunch(x, None), cu.used()]
    # another graph's 2 MiB allocation, kept: the pool's 6 MiB take it, nothing more is charged
    h = cu.graph()
    rc, _, c = cu.alloc_node(h, 2 * MiB)
    params = ctypes.create_string_buffer(32)
    struct.pack_into("<Q", params, 0, 1)                    # flags: AUTO_FREE_ON_LAUNCH
    struct.pack_into("<i", params, 24, 99)                  # result_out, to be overwritten
    y = c_void_p()
    rc = cu.cuGraphInstantiateWithParams(byref(y), h, params)
    o["with_params"] = [rc, struct.unpack_from("<i", params, 24)[0]]
    o["kept"] = [cu.cuGraphLaunch_ptsz(y, None), cu.used(), cu.attrs()]
    o["auto_freed_relaunch"] = [cu.cuGraphLaunch(y, None), cu.used(), cu.attrs()[0]]
    # freed by a graph of its own: then never in its owning graph
    f = cu.graph()
    rc_free = cu.free_node(f, c)
    rc, w = cu.instantiate(f)
    o["freed_by_another_graph"] = [rc_free, rc, cu.cuGraphLaunch(w, None), cu.attrs()[0], cu.free_node(h, c)]
    # the CUDA 11 ABI: no flags, an error node and a log
    k, z, err = cu.graph(), c_void_p(), c_void_p(1)
    log = ctypes.create_string_buffer(b"x" * 8)
    o["instantiate_v2"] = [cu.cuGraphInstantiate_v2(byref(z), k, byref(err), log, c_size_t(8)), err.value,
                           log.value.decode()]
    return o


def scenario_capture(cu: Cu) -> dict:
    cu.primary()
    s, status, g = c_void_p(), ctypes.c_int(), c_void_p()
    o = {"stream": cu.cuStreamCreate(byref(s), 1)}
    o["not_capturing"] = [cu.cuStreamIsCapturing(s, byref(status)), status.value]
    o["begin_legacy"] = cu.cuStreamBeginCapture_v2(None, 2)
    o["begin_bad_mode"] = cu.cuStreamBeginCapture_v2(s, 3)
    o["begin"] = [cu.cuStreamBeginCapture_v2(s, 2), cu.cuStreamBeginCapture_v2(s, 2)]
    o["capturing"] = [cu.cuStreamIsCapturing(s, byref(status)), status.value]
    p = c_uint64()
    o["captured_alloc"] = [cu.cuMemAllocAsync(byref(p), c_size_t(6 * MiB), s), p.value != 0, cu.used()]
    o["end"] = [cu.cuStreamEndCapture(s, byref(g)), g.value is not None, cu.cuStreamEndCapture(s, byref(g))]
    o["ended"] = [cu.cuStreamIsCapturing(s, byref(status)), status.value]
    rc, x = cu.instantiate(g)
    o["launched"] = [rc, cu.cuGraphLaunch(x, s), cu.used(), cu.cuMemsetD8_v2(p, 0, c_size_t(6 * MiB))]
    o["freed"] = [cu.cuMemFreeAsync(p, s), cu.used(), cu.cuDeviceGraphMemTrim(0), cu.used()]
    # the per-thread default stream, its _ptsz calls; a captured free too
    q, g2 = c_uint64(), c_void_p()
    o["ptsz"] = [cu.cuStreamBeginCapture_v2_ptsz(PER_THREAD, 0),
                 cu.cuMemAllocAsync_ptsz(byref(q), c_size_t(MiB), PER_THREAD), cu.cuMemFreeAsync_ptsz(q, PER_THREAD),
                 cu.cuStreamIsCapturing_ptsz(PER_THREAD, byref(status)), status.value,
                 cu.cuStreamEndCapture_ptsz(PER_THREAD, byref(g2)), cu.used()]
    rc, x2 = cu.instantiate(g2)
    o["ptsz_launched"] = [rc, cu.cuGraphLaunch(x2, PER_THREAD), cu.used(), cu.attrs()]
    o["destroyed"] = [cu.cuStreamDestroy_v2(s), cu.cuStreamDestroy_v2(s)]
    return o


def scenario_modules(cu: Cu) -> dict:
    import tempfile

    def image(n):
        return ctypes.create_string_buffer(f"CONVGPU-STANDIN-MODULE {n}\n".encode())

    mods = [c_void_p() for _ in range(6)]
    lib, lib2 = c_void_p(), c_void_p()
    o = {"module_without_context": cu.cuModuleLoadData(byref(mods[0]), image(MiB))}
    o["library_without_context"] = [cu.cuLibraryLoadData(byref(lib), image(2 * MiB), None, None, 0, None, None, 0),
                                    cu.used(), cu.cuLibraryUnload(lib), cu.used()]
    cu.primary()
    o["loaded"] = [cu.cuModuleLoadData(byref(mods[0]), image(5 * MiB)), cu.used()]
    elf = ctypes.create_string_buffer(b"\x7fELF\x02\x01\x01" + bytes(57))
    o["elf"] = [cu.cuModuleLoadData(byref(mods[1]), elf), cu.used()]
    bad = ctypes.create_string_buffer(b"CONVGPU-STANDIN-MODULE 12x\n")
    o["malformed"] = [cu.cuModuleLoadData(byref(mods[2]), bad), cu.used()]
    o["over_capacity"] = [cu.cuModuleLoadData(byref(mods[3]), image(60 * MiB)), cu.used()]
    o["ex"] = [cu.cuModuleLoadDataEx(byref(mods[3]), image(MiB), 0, None, None), cu.used()]
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(f"CONVGPU-STANDIN-MODULE {3 * MiB}\n".encode() + bytes(4096))
        f.flush()
        o["file"] = [cu.cuModuleLoad(byref(mods[4]), f.name.encode()), cu.used()]
        rc = cu.cuLibraryLoadFromFile(byref(lib2), f.name.encode(), None, None, 0, None, None, 0)
        o["library_file"] = [rc, cu.used()]
    o["missing_file"] = cu.cuModuleLoad(byref(mods[5]), b"/nonexistent/x.cubin")
    o["unloaded"] = [[cu.cuModuleUnload(m) for m in mods[:5]], cu.cuLibraryUnload(lib2), cu.used()]
    o["unloaded_twice"] = [cu.cuModuleUnload(mods[0]), cu.cuLibraryUnload(lib2)]
    return o


def scenario_proc_address(cu: Cu) -> dict:
    """cuGetProcAddress_v2 by base name, version and stream flag: which export comes back."""
    def addr(name):
        return ctypes.cast(getattr(cu.lib, name), c_void_p).value

    def got(name, version, flags=0):
        p = c_void_p()
        rc = cu.cuGetProcAddress_v2(name.encode(), byref(p), version, c_uint64(flags), None)
        names = [n for n in EXPORTS if addr(n) == p.value]
        return names[0] if rc == 0 and names else f"rc {rc}"

    return {f"{n} {v} {f}": got(n, v, f) for n, v, f in [
        ("cuGraphInstantiate", 12000, 0), ("cuGraphInstantiate", 11000, 0), ("cuGraphAddNode", 12030, 0),
        ("cuGraphAddNode", 12020, 0), ("cuStreamBeginCapture", 12000, 0), ("cuStreamBeginCapture", 12000, 2),
        ("cuGraphLaunch", 12000, 2), ("cuGraphLaunch", 12000, 0), ("cuCtxSetLimit", 12000, 0)]}


EXPORTS = ["cuGraphInstantiateWithFlags", "cuGraphInstantiate_v2", "cuGraphInstantiate", "cuGraphAddNode_v2",
           "cuGraphAddNode", "cuStreamBeginCapture_v2", "cuStreamBeginCapture_v2_ptsz", "cuGraphLaunch",
           "cuGraphLaunch_ptsz", "cuCtxSetLimit"]
SCENARIOS = {n[len("scenario_"):]: f for n, f in list(globals().items()) if n.startswith("scenario_")}


# ----------------------------------------------------------------- the tests' side


def run_scenario(build, name: str, **env) -> dict:
    shm = f"/convgpu-test-lg-{os.getpid()}-{name}"
    e = dict(os.environ, CONVGPU_STANDIN_SHM=shm, CONVGPU_STANDIN_CAPACITY=str(64 * MiB))
    e.update({k: str(v) for k, v in env.items()})
    try:
        r = subprocess.run([sys.executable, __file__, name, str(build / "standin" / "libcuda.so.1")],
                           env=e, capture_output=True, text=True, timeout=60)
    finally:
        subprocess.run([str(build / "standin" / "standin-usage"), "--unlink"], env=e, capture_output=True)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_limits_charge_at_the_call_and_give_back(build):
    """Stack: 4 resident threads x (value - 1,024); heap and FIFO: value - default, at the call.
    72 MiB of heap does not fit 64 MiB beside the stack: out of memory, the heap stays 8 MiB.
    The last release of the primary context, or a context's destruction, gives all back."""
    o = run_scenario(build, "limits", CONVGPU_STANDIN_RESIDENT_THREADS=4)
    stack32 = 4 * (32 * 1024 - 1024)
    assert o == {
        "no_context": 201,
        "defaults": [1024, MiB, 8 * MiB],
        "stack_64k": [0, 65536, 4 * (65536 - 1024)],
        "stack_32k": [0, 32768, stack32],                       # a lower value gives back
        "heap_72m": [2, 8 * MiB, stack32],                      # OOM: nothing changed
        "heap_40m": [0, 40 * MiB, stack32 + 32 * MiB],
        "fifo_2m": [0, 2 * MiB, stack32 + 33 * MiB],
        "other_limit": [215, "rc 215"],
        "released": [0, "rc 709", 0],
        "retained_again": [1024, MiB, 8 * MiB, 0],
        "created": [0, 4 * (65536 - 1024), 0, 0],
    }


@pytest.mark.parametrize("at", ["launch", "instantiate"])
def test_graph_memory_pool(build, at):
    """An 8 MiB alloc node: no memory when added; taken at the launch (or, GRAPH_AT=instantiate,
    at the instantiation); a free keeps it reserved; destroying the exec and the graph leaves it
    live; trim gives back only what is not live."""
    o = run_scenario(build, "graph", CONVGPU_STANDIN_GRAPH_AT=at)
    m8 = 8 * MiB
    assert o == {
        "added": [0, True, 0],
        "instantiated": [0, m8 if at == "instantiate" else 0],
        "second_exec": 1,
        "launched": [0, m8, [m8, m8, m8, m8]],
        "relaunch_unfreed": [1, m8],
        "memset": [0, 1],
        "freed": [0, m8, [0, m8, m8, m8]],
        "freed_again": [1, 1],
        "relaunched": [0, m8, [m8, m8, m8, m8]],
        "exec_destroyed": [0, m8, [m8, m8, m8, m8]],
        "graph_destroyed": [0, m8],
        "trim_while_live": [0, m8],
        "freed_at_last": [0, m8, [0, m8, m8, m8]],
        "trimmed": [0, 0, [0, m8, 0, m8]],
    }


@pytest.mark.parametrize("at", ["launch", "instantiate"])
def test_graph_out_of_memory_changes_nothing(build, at):
    o = run_scenario(build, "graph_oom", CONVGPU_STANDIN_GRAPH_AT=at, CONVGPU_STANDIN_CAPACITY=16 * MiB)
    if at == "launch":
        assert o == {"instantiated": [0, 10 * MiB, [0, 0, 0, 0]], "launched": [2, 10 * MiB, [0, 0, 0, 0]],
                     "launched_with_room": [0, 8 * MiB]}
    else:
        assert o == {"instantiated": [2, 10 * MiB, [0, 0, 0, 0]], "instantiated_with_room": [0, 8 * MiB],
                     "launched_with_room": [0, 8 * MiB]}


def test_graph_nodes_free_nodes_and_auto_free(build):
    """A graph that allocates 4 + 2 MiB and frees both holds 6 MiB reserved after its launch;
    another graph's 2 MiB then fits in that reservation; AUTO_FREE_ON_LAUNCH relaunches."""
    o = run_scenario(build, "graph_nodes")
    m6 = 6 * MiB
    assert o == {
        "free_node": 0, "free_node_twice": 1, "free_node_not_graph_memory": 1, "free_node_foreign_dependency": 1,
        "free_node_other_graph": 1,
        "add_node_v2_alloc": [0, True], "add_node_v1_free": 0, "add_node_kernel": 801,
        "launched": [0, 0, m6, [0, m6, m6, m6]],
        "relaunched": [0, m6],
        "with_params": [0, 0],
        "kept": [0, m6, [2 * MiB, m6, m6, m6]],
        "auto_freed_relaunch": [0, m6, 2 * MiB],
        "freed_by_another_graph": [0, 0, 0, 0, 1],
        "instantiate_v2": [0, None, ""],
    }


def test_capture_records_nodes_and_takes_nothing_until_launch(build):
    o = run_scenario(build, "capture")
    assert o == {
        "stream": 0, "not_capturing": [0, 0], "begin_legacy": 900, "begin_bad_mode": 1,
        "begin": [0, 401], "capturing": [0, 1],
        "captured_alloc": [0, True, 0],
        "end": [0, True, 401], "ended": [0, 0],
        "launched": [0, 0, 6 * MiB, 0],
        "freed": [0, 6 * MiB, 0, 0],
        "ptsz": [0, 0, 0, 0, 1, 0, 0],
        "ptsz_launched": [0, 0, MiB, [0, 6 * MiB, MiB, 6 * MiB]],
        "destroyed": [0, 400],
    }


def test_modules_take_their_image_bytes_until_unloaded(build):
    o = run_scenario(build, "modules")
    assert o == {
        "module_without_context": 201,
        "library_without_context": [0, 2 * MiB, 0, 0],
        "loaded": [0, 5 * MiB], "elf": [0, 5 * MiB], "malformed": [0, 5 * MiB],
        "over_capacity": [2, 5 * MiB], "ex": [0, 6 * MiB],
        "file": [0, 9 * MiB], "library_file": [0, 12 * MiB], "missing_file": 301,
        "unloaded": [[0, 0, 0, 0, 0], 0, 0], "unloaded_twice": [400, 400],
    }


def test_proc_address_picks_the_version_asked_for(build):
    o = run_scenario(build, "proc_address")
    assert o == {
        "cuGraphInstantiate 12000 0": "cuGraphInstantiateWithFlags",
        "cuGraphInstantiate 11000 0": "cuGraphInstantiate_v2",
        "cuGraphAddNode 12030 0": "cuGraphAddNode_v2",
        "cuGraphAddNode 12020 0": "cuGraphAddNode",
        "cuStreamBeginCapture 12000 0": "cuStreamBeginCapture_v2",
        "cuStreamBeginCapture 12000 2": "cuStreamBeginCapture_v2_ptsz",
        "cuGraphLaunch 12000 2": "cuGraphLaunch_ptsz",
        "cuGraphLaunch 12000 0": "cuGraphLaunch",
        "cuCtxSetLimit 12000 0": "cuCtxSetLimit",
    }


# cgcaller's families, held at their peak: the slot of the process (NVML's per-process memory)
FAMILIES = [
    ("stack", ["-s", "64K"], {"CONVGPU_STANDIN_RESIDENT_THREADS": "4"}, (1, 64 << 10), 4 * (65536 - 1024)),
    ("heap", ["-s", "64M"], {}, (1, 64 * MiB), 56 * MiB),
    ("fifo", ["-s", "3M"], {}, (1, 3 * MiB), 2 * MiB),
    ("graph", ["-s", "3M", "-n", "2"], {}, (2, 6 * MiB), 2 * 4 * MiB),         # 2 MiB pages
    ("capture", ["-s", "5M", "-n", "2", "-t", "2"], {}, (4, 20 * MiB), 4 * 6 * MiB),
    ("module", ["-s", "7M", "-n", "3"], {}, (3, 21 * MiB), 21 * MiB),
]


@pytest.mark.parametrize("family,args,env,allocated,held", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_cgcaller_family_holds_its_peak_and_gives_it_back(build, run_caller, caller_env, family, args, env,
                                                          allocated, held):
    from conftest import StandinNvml
    nvml = StandinNvml(caller_env["CONVGPU_STANDIN_SHM"])
    c = run_caller(family, *args, "--hold-freed", env=env)
    assert c.allocated == allocated
    assert nvml.process_memory().get((c.pid, 0), 0) == held
    c.p.stdin.write("\n")
    c.p.stdin.flush()
    c._read_until("freed")
    assert c.freed == allocated
    assert nvml.process_memory().get((c.pid, 0), 0) == 0        # alive, everything given back
    assert c.release() == 0


def test_standin_nvml_lists_the_slots_when_asked(build, run_caller, caller_env):
    """With CONVGPU_STANDIN_NVML_PROCS=1 the stand-in NVML lists compute processes from the
    slots (what pynvml, and so the enforcer's sampler, reads); without it, NOT_SUPPORTED, as
    NVML where it has no per-process figures."""
    c = run_caller("stack", "-s", "64K", env={"CONVGPU_STANDIN_RESIDENT_THREADS": "4"})
    code = ("import pynvml\npynvml.nvmlInit()\nh = pynvml.nvmlDeviceGetHandleByIndex(0)\n"
            "try:\n    print({p.pid: p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)})\n"
            "except pynvml.NVMLError as e:\n    print(repr(str(e)))\n")
    env = dict(caller_env, LD_LIBRARY_PATH=str(build / "standin-nvml"))
    listed = [subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=30)
              for e in (dict(env, CONVGPU_STANDIN_NVML_PROCS="1"), env)]
    assert ast.literal_eval(listed[0].stdout)[c.pid] == 4 * (65536 - 1024), listed[0].stderr
    assert listed[1].stdout.strip() == repr("Not Supported"), listed[1].stderr
    c.release()


def test_cgcaller_ctxlimit_each_context_takes_its_own_limit(build, run_caller, caller_env):
    """The driver keeps limits per context (issue 47): four contexts with a 200 MiB heap take 4 x
    192 MiB in the slot; destroying one gives its limit back; the exit, the rest."""
    from conftest import StandinNvml
    nvml = StandinNvml(caller_env["CONVGPU_STANDIN_SHM"])
    c = run_caller("ctxlimit", "-n", 4, "-s", "200M", "--limit", "heap", "--hold-freed")
    assert c.allocated == (4, 4 * 200 * MiB)
    assert nvml.process_memory()[(c.pid, 0)] == 4 * 192 * MiB
    c.p.stdin.write("\n")
    c.p.stdin.flush()
    c._read_until("freed")
    assert c.freed == (1, 200 * MiB)
    assert nvml.process_memory()[(c.pid, 0)] == 3 * 192 * MiB
    assert c.release() == 0
    assert nvml.process_memory().get((c.pid, 0), 0) == 0


def test_standin_nvml_lists_a_process_with_two_driver_copies_twice(build, caller_env, tmp_path):
    """Each copy of the driver a process loads is a client of its own, with a slot of its own:
    NVML lists the process once per copy, and probes.nvml sums its rows (issue 47: the larger
    row alone made 400 MiB read as 200)."""
    copy = tmp_path / "libcuda-second.so"
    shutil.copy(build / "standin" / "libcuda.so.1", copy)
    env = dict(caller_env, CONVGPU_STANDIN_ALLOC_MS="300")
    p = subprocess.Popen([str(build / "reenter"), str(200 * MiB), "100", str(copy)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert p.stdout.readline().split()[:3] == ["allocated", "2", str(400 * MiB)], p.stderr.read()
        code = ("import pynvml, sys\nfrom convgpu.probes.nvml import Nvml\npynvml.nvmlInit()\n"
                "h = pynvml.nvmlDeviceGetHandleByIndex(0)\n"
                "rows = sorted((q.pid, q.usedGpuMemory) for q in pynvml.nvmlDeviceGetComputeRunningProcesses(h))\n"
                "print([r for r in rows if r[0] == int(sys.argv[1])], Nvml().process_memory()[(int(sys.argv[1]), 0)])\n")
        r = subprocess.run([sys.executable, "-c", code, str(p.pid)], capture_output=True, text=True, timeout=30,
                           env=dict(caller_env, LD_LIBRARY_PATH=str(build / "standin-nvml"),
                                    CONVGPU_STANDIN_NVML_PROCS="1"))
        rows, total = r.stdout.rsplit(" ", 1)
        assert ast.literal_eval(rows) == [(p.pid, 200 * MiB), (p.pid, 200 * MiB)], r.stderr
        assert int(total) == 400 * MiB
    finally:
        p.kill()
        p.wait()


@pytest.mark.parametrize("at", ["launch", "instantiate"])
def test_graphprobe_steps(build, caller_env, at):
    """cgcaller graphprobe (tests/gpu/probe_graph_timing.sh runs it on a GPU): the slot after
    each step, and the driver's own graph figures on each step line."""
    from conftest import StandinNvml, lines_until
    nvml = StandinNvml(caller_env["CONVGPU_STANDIN_SHM"])
    env = dict(caller_env, CONVGPU_STANDIN_RESIDENT_THREADS="4", CONVGPU_STANDIN_GRAPH_AT=at)
    p = subprocess.Popen([str(build / "cgcaller"), "graphprobe", "-s", "64M", "--hold"], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    seen, lines = [], []
    try:
        while True:
            line = lines_until(p.stdout, lambda s: s.startswith(("step", "exit")), lines, 10, "graphprobe")
            if line == "exit":
                break
            f = line.split()
            seen.append((f[1], int(f[2].split("=")[1]), int(f[3].split("=")[1]),
                         nvml.process_memory().get((p.pid, 0), 0)))
            p.stdin.write("\n")
            p.stdin.flush()
        assert p.wait(timeout=10) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    stack, g = 4 * (65536 - 1024), 64 * MiB
    taken_at_instantiate = g if at == "instantiate" else 0
    # (step, graph used, graph reserved, the slot)
    assert seen == [
        ("context", 0, 0, 0), ("stack-64KiB", 0, 0, stack), ("node-added", 0, 0, stack),
        ("instantiated", 0, taken_at_instantiate, stack + taken_at_instantiate),
        ("launched", g, g, stack + g), ("memset", g, g, stack + g), ("exec-destroyed", g, g, stack + g),
        ("graph-destroyed", g, g, stack + g), ("trimmed", g, g, stack + g), ("freed", 0, g, stack + g),
        ("trimmed-after-free", 0, 0, stack), ("heap-4GiB", 0, 0, stack + 4 * GiB - 8 * MiB)]


# ----------------------------------------------------------------- cuda_min.h vs cuda.h

def cuda_h():
    if not (CUDA_INCLUDE / "cuda.h").exists():
        pytest.skip(f"no CUDA toolkit headers in {CUDA_INCLUDE}: cuda_min.h's static asserts stand alone")


def gcc(code: str, *flags) -> subprocess.CompletedProcess:
    return subprocess.run(["gcc", "-std=gnu11", *flags, "-x", "c", "-"], input=code, capture_output=True,
                          text=True, env=dict(os.environ, LC_ALL="C"))


# (type, member or "" for sizeof) for every struct the stand-in reads or writes
LAYOUT = [(t, m) for t, ms in {
    "CUDA_MEM_ALLOC_NODE_PARAMS": ["poolProps", "poolProps.location", "poolProps.location.id", "poolProps.maxSize",
                                   "poolProps.usage", "accessDescs", "accessDescCount", "bytesize", "dptr", ""],
    "CUDA_MEM_ALLOC_NODE_PARAMS_v2": ["bytesize", "dptr", ""],
    "CUmemPoolProps": ["allocType", "handleTypes", "location", "win32SecurityAttributes", "maxSize", "usage",
                       "reserved", ""],
    "CUgraphNodeParams": ["type", "reserved0", "alloc", "alloc.bytesize", "alloc.dptr", "free", "free.dptr",
                          "reserved2", ""],
    "CUDA_MEM_FREE_NODE_PARAMS": ["dptr", ""],
    "CUDA_GRAPH_INSTANTIATE_PARAMS": ["flags", "hUploadStream", "hErrNode_out", "result_out", ""],
    "CUgraphEdgeData": ["type", "reserved", ""],
    "CUmemAllocationProp": ["type", "requestedHandleTypes", "location", "win32HandleMetaData", "allocFlags", ""],
    "CUmemAccessDesc": ["location", "flags", ""],
    "CUDA_ARRAY_DESCRIPTOR": ["Height", "Format", "NumChannels", ""],
    "CUDA_ARRAY3D_DESCRIPTOR": ["Depth", "Format", "NumChannels", "Flags", ""],
    "CUuuid": [""],
    "CUlimit": [""], "CUjit_option": [""], "CUlibraryOption": [""], "CUgraphMem_attribute": [""],
    "CUstreamCaptureStatus": [""], "CUstreamCaptureMode": [""], "CUgraphNodeType": [""],
    "CUdeviceptr": [""], "CUmemGenericAllocationHandle": [""],
    "CUcheckpointLockArgs": ["timeoutMs", "reserved0", "reserved1", ""],
    "CUcheckpointCheckpointArgs": ["reserved", ""],
    "CUcheckpointGpuPair": ["oldUuid", "newUuid", ""],
    "CUcheckpointRestoreArgs": ["gpuPairs", "gpuPairsCount", "reserved", "reserved1", ""],
    "CUcheckpointUnlockArgs": ["reserved", ""], "CUprocessState": [""],
}.items() for m in ms]


def layout_program() -> str:
    """Prints every LAYOUT entry and every enum value and #define of cuda_min.h."""
    src = CUDA_MIN.read_text()
    names = set(re.findall(r"^\s+(CU[A-Z0-9_]+|CUDA_[A-Z0-9_]+)\s*(?:=|,|$)", src, re.M))
    names |= set(re.findall(r"^#define (CU_[A-Z0-9_]+|cuda[A-Z]\w+) ", src, re.M))
    lines = [f'printf("sizeof {t} %zu\\n", sizeof({t}));' if not m else
             f'printf("offsetof {t}.{m} %zu\\n", offsetof({t}, {m}));' for t, m in LAYOUT]
    lines += [f'printf("{n} %lld\\n", (long long)(size_t)({n}));' for n in sorted(names)]
    return "#include <stddef.h>\n#include <stdio.h>\nint main(void) {\n" + "\n".join(lines) + "\nreturn 0;\n}\n"


def layouts_with(tmp_path, header: str, *flags) -> str:
    exe = tmp_path / f"layout-{header}"
    r = gcc(f"#include <{header}>\n" + layout_program(), *flags, "-o", str(exe))
    assert r.returncode == 0, r.stderr
    return subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout


def test_cuda_min_layouts_and_values_are_cuda_h_s(tmp_path):
    cuda_h()
    ours = layouts_with(tmp_path, "cuda_min.h", f"-I{CUDA_MIN.parent}")
    theirs = layouts_with(tmp_path, "cuda.h", f"-I{CUDA_INCLUDE}", "-include", "cuda_runtime_api.h")
    assert "offsetof CUDA_MEM_ALLOC_NODE_PARAMS.bytesize 104" in ours      # the H200 run's offsets
    assert "offsetof CUDA_MEM_ALLOC_NODE_PARAMS.dptr 112" in ours
    assert ours.splitlines() == theirs.splitlines()


def test_cuda_min_prototypes_are_cuda_h_s():
    """Each prototype of cuda_min.h, placed after cuda.h, redeclares one of cuda.h's (gcc's
    -Wredundant-decls names it) in one of its three modes: plain, per-thread default stream
    (the _ptsz/_ptds names), or the driver's own build (the older ABIs it still exports:
    cuGraphInstantiate_v2, cuGraphAddNode's first version...); and conflicts with none."""
    cuda_h()
    src = CUDA_MIN.read_text()
    block = src.split("#pragma GCC visibility push(default)")[1].split("#pragma GCC visibility pop")[0]
    names = re.findall(r"\b(cu\w+|cuda\w+)\s*\(", block)
    code = ("#include <cuda.h>\n#include <cuda_runtime_api.h>\n" + "".join(f"#undef {n}\n" for n in names)
            + block)
    redeclared, errors = set(), []
    for mode in ([], ["-DCUDA_API_PER_THREAD_DEFAULT_STREAM"], ["-D__CUDA_API_VERSION_INTERNAL"]):
        r = gcc(code, "-fsyntax-only", "-Wredundant-decls", f"-I{CUDA_INCLUDE}", *mode)
        redeclared |= set(re.findall(r"redundant redeclaration of '(\w+)'", r.stderr))
        errors += [line for line in r.stderr.splitlines() if ": error:" in line]
    assert errors == []
    assert len(names) == len(set(names)) > 90
    assert sorted(set(names) - redeclared) == []


if __name__ == "__main__":      # a scenario's child: SCENARIO LIBCUDA
    print(json.dumps(SCENARIOS[sys.argv[1]](Cu(sys.argv[2]))))
