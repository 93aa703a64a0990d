"""Every charge on the right GPU (issue 25): a process's CUDA ordinals are its own (FACTS.md,
2026-11-25), and convgpu charges, traces and limits the host GPU behind each. The stand-in
driver with two GPUs honours CUDA_VISIBLE_DEVICES as the real driver does, and with
CONVGPU_STANDIN_DEVNODES keeps a device node per visible GPU open, as the driver keeps
/dev/nvidiaN; here those nodes are char 1:3 and 1:5 (/dev/null's and /dev/zero's numbers: the
only openable nodes a host without NVIDIA's driver has), and the mapper is told major 1.
Real uprobes, real cgroups; `convgpu trace --json` as a subprocess, the enforcer in-process."""
import json
import os
import subprocess
import sys
import time

import pytest

from conftest import (GiB, MiB, StandinNvml, inprocess_enforcer, kill_if_running, lines_until, popen_in,
                      serving, until, wait_state)

pytestmark = pytest.mark.system
UUID = ["GPU-5ca1ab1e-0000-4000-8000-000000000000", "GPU-5ca1ab1e-0000-4000-8000-000000000001"]
MINORS = (3, 5)

# argv: lib, then "ORDINAL:MIB" steps; prints the device count, "ready" once all are done,
# then waits for a line; a second line: one more 700 MiB on its current device.
SCRIPT = r"""
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
rc = lib.cuInit(0)
n = ctypes.c_int(-1)
lib.cuDeviceGetCount(ctypes.byref(n))
print(f"init {rc} count {n.value}", flush=True)
ctx, ptr = {}, ctypes.c_uint64()
for step in sys.argv[2:]:
    dev, mib = map(int, step.split(":"))
    if dev not in ctx:
        ctx[dev] = ctypes.c_void_p()
        assert lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx[dev]), dev) == 0
    assert lib.cuCtxSetCurrent(ctx[dev]) == 0
    assert lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(mib << 20)) == 0
print("ready", flush=True)
sys.stdin.readline()
print("more", lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(700 << 20)), flush=True)
sys.stdin.readline()
"""


class TwoGpus(StandinNvml):
    """NVML's facts of the stand-in's two GPUs: UUIDs as the driver's, minors 3 and 5."""

    def gpus(self):
        from convgpu.probes.nvml import GpuInfo
        return [GpuInfo(d, "Stand-in GPU", 4 * GiB, 0, UUID[d], MINORS[d]) for d in (0, 1)]


@pytest.fixture
def two(caller_env, tmp_path, root):
    nodes = tmp_path / "dev"
    nodes.mkdir()
    for h, minor in enumerate(MINORS):
        os.mknod(nodes / f"nvidia{h}", 0o600 | 0o020000, os.makedev(1, minor))
    env = dict(caller_env, CONVGPU_STANDIN_DEVICES="2", CONVGPU_STANDIN_DEVNODES=str(nodes),
               CONVGPU_STANDIN_SHM=f"/convgpu-gpumap-{os.getpid()}-{time.monotonic_ns()}")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    yield env
    subprocess.run([env["LD_LIBRARY_PATH"] + "/standin-usage", "--unlink"], env=env, capture_output=True)


def start(cg, build, env, cvd, *steps):
    e = dict(env) if cvd is None else dict(env, CUDA_VISIBLE_DEVICES=cvd)
    p = popen_in(cg, sys.executable, "-c", SCRIPT, build / "standin" / "libcuda.so.1", *steps, env=e)
    return p


def enforcer(build, env, tag, **kw):
    enf = inprocess_enforcer(str(build / "standin" / "libcuda.so.1"), tag, GiB, {0: 4 * GiB, 1: 4 * GiB},
                             nvml=TwoGpus(env["CONVGPU_STANDIN_SHM"]), **kw)
    if hasattr(enf.tracer, "gpumap"):   # (so that the code before issue 25 fails on what it charges)
        enf.tracer.gpumap.major = 1     # the stand-in's nodes (see the module's text)
    return enf


def box_of(enf, name):
    return next(b for b in enf.books.boxes.values() if b.name == name)


def mapping_of(enf, pid):
    return next(r for r in enf.status().get("gpu_mappings", []) if r["pid"] == pid)


@pytest.mark.parametrize("cvd", ["1", UUID[1]])
def test_trace_json_shows_a_process_seeing_gpu_1_on_gpu_1(build, two, cgroups, cvd):
    lib = str(build / "standin" / "libcuda.so.1")
    tr = subprocess.Popen([sys.executable, "-m", "convgpu.cli.main", "trace", "--json", "--interval", "0.2",
                           "--demo", "never", "--no-discover", "--lib", lib],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=dict(os.environ, LD_LIBRARY_PATH=str(build / "standin-nvml"),
                                   CONVGPU_STANDIN_DEVICES="2", CONVGPU_STANDIN_MINORS="3,5"))
    p = None
    try:
        json.loads(tr.stdout.readline())   # probes attached
        p = start(cgroups("trace"), build, two, cvd, "0:300")
        out = []
        lines_until(p.stdout, lambda line: line.strip() == "ready", out, 20, "the process")
        assert out[0].strip() == "init 0 count 1"
        rows, allocs = [], []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not (rows and allocs):
            d = json.loads(tr.stdout.readline())
            if d.get("type") == "event" and d["pid"] == p.pid and d["op"] == "alloc":
                allocs.append(d)
            elif "containers" in d:
                rows = [(q["pid"], q["gpu"], q["live"]) for c in d["containers"] for q in c["processes"]
                        if q["pid"] == p.pid]
        assert [(a["dev"], a.get("gpu_uuid"), a["size"]) for a in allocs] == [(1, UUID[1], 300 * MiB)]
        assert rows == [(p.pid, 1, 300 * MiB)]
    finally:
        kill_if_running(tr)
        if p is not None:
            p.kill()
            p.wait()


def test_enforced_on_gpu_1_and_gpu_0_untouched(build, two, cgroups):
    enf = enforcer(build, two, "cvd1")
    with serving(enf):
        p = start(cgroups("cvd1"), build, two, "1", "0:600")
        try:
            lines_until(p.stdout, lambda line: line.strip() == "ready", [], 20, "the process")
            box = box_of(enf, "cvd1")
            until(lambda: enf.books.usage(box, 1)[:2] == (600 * MiB, 1), 5, "GPU1's usage")
            assert set(box.assigned) == {1}            # GPU 0: no assignment, no state
            m = mapping_of(enf, p.pid)
            assert (m["hosts"], m["certain"], m["also"]) == ([1], True, [])
            assert enf.status()["gpus"]["1"]["uuid"] == UUID[1]
            p.stdin.write("\n")
            p.stdin.flush()     # 600 + 700 MiB > the 1 GiB limit: stopped, on GPU 1
            wait_state(p.pid, "T")   # stopped by BPF; the enforcer's loop records it just after
            until(lambda: box.waiting.keys() == {1}, 5, "the stall recorded on GPU1")
            until(lambda: box.waiting[1].over_limit, 5, "the wait called over the limit (the next pass)")
            assert enf.books.usage(box, 1)[:2] == (600 * MiB, 1) and 0 not in box.assigned
        finally:
            p.kill()
            p.wait()


def test_reversed_list_charges_each_ordinal_to_its_host_gpu(build, two, cgroups):
    enf = enforcer(build, two, "rev")
    with serving(enf):
        p = start(cgroups("rev"), build, two, "1,0", "0:100", "1:200")
        try:
            lines_until(p.stdout, lambda line: line.strip() == "ready", [], 20, "the process")
            box = box_of(enf, "rev")
            until(lambda: enf.books.usage(box, 0)[:2] == (200 * MiB, 1), 5, "GPU0's usage")
            assert enf.books.usage(box, 1)[:2] == (100 * MiB, 1)
            assert {u.dev: u.live for u in enf.tracer.usage() if u.pid == p.pid} == {0: 200 * MiB, 1: 100 * MiB}
            assert mapping_of(enf, p.pid)["hosts"] == [1, 0]
        finally:
            p.kill()
            p.wait()


def test_empty_list_sees_no_gpu_and_is_charged_nothing(build, two, cgroups):
    enf = enforcer(build, two, "empty")
    with serving(enf):
        p = start(cgroups("empty"), build, two, "")
        try:
            out = []
            lines_until(p.stdout, lambda line: line.strip() == "ready", out, 20, "the process")
            assert out[0].strip() == "init 100 count -1"     # CUDA_ERROR_NO_DEVICE, as the driver
            time.sleep(0.3)
            assert [u for u in enf.tracer.usage() if u.pid == p.pid] == [] and not enf.books.boxes
        finally:
            p.kill()
            p.wait()


def test_a_rewritten_environment_does_not_move_its_charges(build, two, cgroups):
    """The driver read CUDA_VISIBLE_DEVICES=1 at cuInit; the process then rewrites its
    environment area (what /proc/PID/environ shows) to say 0. The node it opened says GPU 1."""
    lie = SCRIPT.replace('print(f"init', 'import re\nst = open("/proc/self/stat").read().rsplit(")", 1)[1].split()\n'
                         'start, end = int(st[47]), int(st[48])\n'  # env_start, env_end (proc(5) fields 50, 51)
                         'with open("/proc/self/mem", "r+b", buffering=0) as m:\n'
                         '    m.seek(start); area = m.read(end - start)\n'
                         '    at = area.index(b"CUDA_VISIBLE_DEVICES=1") + 21\n'
                         '    m.seek(start + at); m.write(b"0")\n'
                         'print(f"init', 1)
    enf = enforcer(build, two, "lie")
    with serving(enf):
        e = dict(two, CUDA_VISIBLE_DEVICES="1")
        p = popen_in(cgroups("lie"), sys.executable, "-c", lie, build / "standin" / "libcuda.so.1", "0:300", env=e)
        try:
            lines_until(p.stdout, lambda line: line.strip() == "ready", [], 20, "the process")
            assert b"CUDA_VISIBLE_DEVICES=0" in open(f"/proc/{p.pid}/environ", "rb").read()
            box = box_of(enf, "lie")
            until(lambda: enf.books.usage(box, 1)[:2] == (300 * MiB, 1), 5, "GPU1's usage")
            assert set(box.assigned) == {1}
            m = mapping_of(enf, p.pid)
            assert (m["hosts"], m["certain"]) == ([1], True) and "not believed" in m["how"]
        finally:
            p.kill()
            p.wait()


@pytest.mark.parametrize("charge", ["all", "guess"])
def test_unmappable_is_said_and_charged_to_every_gpu_it_may_use(build, two, cgroups, charge, caplog):
    """No device node open (CONVGPU_STANDIN_DEVNODES unset): nothing the kernel says fixes
    where ordinal 0 is. `all` charges it on both GPUs; `guess` on its environment's GPU only."""
    env = {k: v for k, v in two.items() if k != "CONVGPU_STANDIN_DEVNODES"}
    enf = enforcer(build, env, f"un{charge}", unmapped_charge=charge)
    with serving(enf):
        p = start(cgroups(f"un{charge}"), build, env, "1", "0:300")
        try:
            lines_until(p.stdout, lambda line: line.strip() == "ready", [], 20, "the process")
            box = box_of(enf, f"un{charge}")
            until(lambda: enf.books.usage(box, 1)[:2] == (300 * MiB, 1), 5, "GPU1's usage")
            m = mapping_of(enf, p.pid)
            assert (m["hosts"], m["certain"], m["also"]) == ([1], False, [0, 1])
            assert enf.status()["unmapped_charge"] == charge
            if charge == "all":
                assert set(box.assigned) == {0, 1} and enf.books.usage(box, 0)[:2] == (300 * MiB, 1)
            else:
                assert set(box.assigned) == {1}
            assert any(f"pid {p.pid}: CUDA devices [0] are host GPUs [1]: no GPU device node open" in r.message
                       for r in caplog.records)
        finally:
            p.kill()
            p.wait()
        until(lambda: enf.books.usage(box, 0)[:2] == (0, 0) and enf.books.usage(box, 1)[:2] == (0, 0), 5, "its exit")


# A context on device 0 of the driver at `lib`, and 300 MiB there (in the scripts below).
ON_DEVICE_0 = """
cu = ctypes.CDLL(lib)
assert cu.cuInit(0) == 0
c = ctypes.c_void_p()
assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(c), 0) == 0 and cu.cuCtxSetCurrent(c) == 0
p = ctypes.c_uint64()
assert cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(300 << 20)) == 0
"""

# Under the preload shim: a context and 300 MiB on its device 0, then what cuMemGetInfo_v2 says
# of its device and NVML of each host GPU (NVML numbers GPUs in host order). argv[2] "nvml":
# an NVML query first, so that the shim says hello before cuInit opened any device node.
SHIM_VIEW = r"""
import ctypes, json, sys
import pynvml
if sys.argv[2] == "nvml":
    pynvml.nvmlInit(); pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(1))
lib = sys.argv[1]
""" + ON_DEVICE_0 + r"""
f, t = ctypes.c_size_t(), ctypes.c_size_t()
assert cu.cuMemGetInfo_v2(ctypes.byref(f), ctypes.byref(t)) == 0
pynvml.nvmlInit()
nv = [pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)) for i in (0, 1)]
print(json.dumps({"cuda": [t.value, f.value], "nvml": [[m.total, m.used] for m in nv]}), flush=True)
sys.stdin.readline()
"""


@pytest.mark.parametrize("first", ["cuda", "nvml"])
@pytest.mark.parametrize("mode", ["shim-only", "shim+probes"])
def test_the_shim_speaks_of_host_gpus(build, two, cgroups, mode, first):
    """The shim's messages name the process's own ordinal (CUDA) or NVML's minor number: with
    CUDA_VISIBLE_DEVICES=1 its device 0 is host GPU 1, so its bytes and context are charged
    there (the ledger's books without probes, BPF's with), and what cuMemGetInfo_v2 and NVML
    show it is GPU 1's view; GPU 0 shows its container nothing. Before: the ledger charged
    GPU 0, BPF too (a shim user was placed at its hello, never mapped), and the CUDA view was
    GPU 0's. `nvml` first: its hello comes before cuInit, when nothing tells its GPUs yet."""
    from convgpu.enforcer.daemon import Enforcer
    from convgpu.enforcer.tenants.limits import LimitRules
    from convgpu.probes.ledger import Ledger
    from conftest import run_dir_for, shim_env
    if mode == "shim-only":
        run_dir = run_dir_for("shimmap")
        enf = Enforcer(Ledger(), "fifo", {0: 4 * GiB, 1: 4 * GiB}, LimitRules({}, GiB), run_dir=run_dir,
                       state_dir=run_dir, nvml=TwoGpus(two["CONVGPU_STANDIN_SHM"]), ctx_overhead=0)   # as conftest's
    else:
        enf = enforcer(build, two, "shimmap")
    enf.tracer.gpumap.major = 1
    with serving(enf):
        e = shim_env(two, enf, CUDA_VISIBLE_DEVICES="1", CONVGPU_STANDIN_MINORS="3,5",
                     LD_LIBRARY_PATH=f"{build}/standin-nvml:{two['LD_LIBRARY_PATH']}")
        p = popen_in(cgroups("shimmap"), sys.executable, "-c", SHIM_VIEW, build / "standin" / "libcuda.so.1", first,
                     env=e)
        try:
            out = []
            lines_until(p.stdout, lambda line: line.startswith("{"), out, 20, "the process")
            view = json.loads(out[-1])
            box = box_of(enf, "shimmap")
            until(lambda: enf.books.usage(box, 1)[:2] == (300 * MiB, 1), 5, "GPU1's usage")
            assert enf.books.usage(box, 0)[:2] == (0, 0)
            (t0, used0), (t1, used1) = view["nvml"]
            assert (used0, used1) == (0, 300 * MiB)           # NVML: GPU 1 holds its 300 MiB
            assert view["cuda"][0] == t1 and view["cuda"][0] - view["cuda"][1] == 300 * MiB
            assert mapping_of(enf, p.pid)["hosts"] == [1]
            assert p.pid in enf.books.shimmed                       # a shim user, whichever came first
        finally:
            p.kill()
            p.wait()


def test_unmappable_vmm_bytes_leave_every_gpu_they_counted_on(build, two, cgroups):
    """cuMemRelease while mapped, then cuMemUnmap: the bytes go at the unmap, inside its loop
    over mappings, which gives them back on the process's own GPU and settles its `also` GPUs
    once after the loop (bpf/books.bpf.c charge_others). Every GPU they counted on drops to
    0 while the process still lives (its exit would have hidden a leftover)."""
    env = {k: v for k, v in two.items() if k != "CONVGPU_STANDIN_DEVNODES"}
    enf = enforcer(build, env, "unvmm")
    with serving(enf):
        p = popen_in(cgroups("unvmm"), build / "cgcaller", "vmm", "-n", 4, "-s", 2 * MiB, "--hold", "--hold-freed",
                     env=dict(env, CUDA_VISIBLE_DEVICES="1"))
        try:
            lines_until(p.stdout, lambda line: line.strip() == "ready", [], 20, "cgcaller")
            box = box_of(enf, "unvmm")
            until(lambda: [enf.books.usage(box, d)[0] for d in (0, 1)] == [8 * MiB] * 2, 5, "both GPUs charged")
            assert mapping_of(enf, p.pid)["also"] == [0, 1]
            p.stdin.write("\n")
            p.stdin.flush()
            lines_until(p.stdout, lambda line: line.startswith("freed"), [], 20, "cgcaller")
            until(lambda: [enf.books.usage(box, d)[0] for d in (0, 1)] == [0, 0], 5, "both GPUs given back")
            assert p.poll() is None
        finally:
            p.kill()
            p.wait()


HELLO_THEN_DRIVER = r"""
import ctypes, json, socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
s.sendall(b'{"op":"hello"}\n')
assert json.loads(s.makefile("rb").readline())["ok"]
lib = sys.argv[2]
""" + ON_DEVICE_0 + r"""
print("ready", flush=True)
sys.stdin.readline()
"""


def test_hello_then_the_driver_is_charged_on_its_host_gpu(build, two, cgroups):
    """Issue 24 row 2 meets issue 25: in a container already placed on GPU 0 (a sibling holds
    100 MiB there), a process says hello on the shim socket before cuInit, then calls the
    driver itself with CUDA_VISIBLE_DEVICES=1. It is no member before its GPUs can be read, so
    its first call stops for placement, which maps it: its context and 300 MiB count on GPU 1.
    Before, its hello made it a member never mapped, admitted on its container's GPU 0
    assignment: charged on GPU 0, GPU 1's limit never applied to it."""
    enf = enforcer(build, two, "hello1")
    cg = cgroups("hello1")
    with serving(enf):
        sib = start(cg, build, two, "0", "0:100")
        p = None
        try:
            lines_until(sib.stdout, lambda line: line.strip() == "ready", [], 20, "the sibling")
            box = box_of(enf, "hello1")
            until(lambda: enf.books.usage(box, 0)[:2] == (100 * MiB, 1), 5, "GPU0's usage")
            p = popen_in(cg, sys.executable, "-c", HELLO_THEN_DRIVER, f"{enf.run_dir}/shim/shim.sock",
                         build / "standin" / "libcuda.so.1", env=dict(two, CUDA_VISIBLE_DEVICES="1"))
            lines_until(p.stdout, lambda line: line.strip() == "ready", [], 20, "the process")
            until(lambda: enf.books.usage(box, 1)[:2] == (300 * MiB, 1), 5, "GPU1's usage")
            assert enf.books.usage(box, 0)[:2] == (100 * MiB, 1) and mapping_of(enf, p.pid)["hosts"] == [1]
        finally:
            for q in (sib, p):
                if q is not None:
                    q.kill()
                    q.wait()
