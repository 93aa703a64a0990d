"""CUDA ordinals mapped to host GPUs on the real driver (issue 25). One GPU: the UUID form of
CUDA_VISIBLE_DEVICES maps to GPU 0, established by the /dev/nvidia0 node the driver opened;
an empty CUDA_VISIBLE_DEVICES sees no GPU and is charged nothing. Two GPUs (skipped with
fewer): CUDA_VISIBLE_DEVICES=1 is charged, traced and limited on GPU 1 while GPU 0 is
untouched, and =1,0 puts each ordinal on its host GPU. The enforcer and trace run as the CLI."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import lines_until, need

pytestmark = pytest.mark.gpu
GiB, MiB = 1 << 30, 1 << 20
RUN_DIR = f"/run/convgpu-gpu-gpumap-{os.getpid()}"

# cuInit, then the driver's device nodes this process holds (kernel facts), the count, and
# the UUID of each ordinal; "ORDINAL:MIB" steps allocate; then waits for a line.
SCRIPT = r"""
import ctypes, json, os, sys
cu = ctypes.CDLL("libcuda.so.1")
rc = cu.cuInit(0)
def link(fd):   # listdir's own descriptor is gone by the time it is read
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""
nodes = sorted({x for x in map(link, os.listdir("/proc/self/fd")) if x.startswith("/dev/nvidia")})
n = ctypes.c_int(-1)
cu.cuDeviceGetCount(ctypes.byref(n))
uuids = []
for o in range(max(n.value, 0)):
    u = (ctypes.c_ubyte * 16)()
    cu.cuDeviceGetUuid_v2(u, o)
    h = bytes(u).hex()
    uuids.append(f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}")
ctx, ptr = {}, ctypes.c_uint64()
for step in sys.argv[1:]:
    dev, mib = map(int, step.split(":"))
    if dev not in ctx:
        ctx[dev] = ctypes.c_void_p()
        assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx[dev]), dev) == 0
    assert cu.cuCtxSetCurrent(ctx[dev]) == 0
    assert cu.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(mib << 20)) == 0
print(json.dumps({"pid": os.getpid(), "init": rc, "count": n.value, "uuids": uuids, "nodes_at_init": nodes}),
      flush=True)
sys.stdin.readline()
"""


def gpus():
    from convgpu.probes.nvml import Nvml
    n = Nvml()
    need(n.ok, f"no NVML: {n.error}")
    return n, n.gpus()


def record(scenario, **data):
    if os.environ.get("CONVGPU_GPU_LOG"):
        with open(os.environ["CONVGPU_GPU_LOG"], "a") as f:
            f.write(json.dumps({"scenario": scenario, **data}) + "\n")


class Enforcer:
    def __init__(self, cg_base: Path):
        self.base = cg_base
        self.p = subprocess.Popen([sys.executable, "-m", "convgpu.cli.main", "enforce", "--gpu-memory", "8GiB",
                                   "--default-limit", "4GiB", "--run-dir", RUN_DIR],
                                  stderr=subprocess.PIPE, text=True, cwd="/")
        self.log = []
        self.procs = []
        lines_until(self.p.stderr, lambda line: "enforcing:" in line, self.log, 90, "enforcer log")

    def status(self):
        r = subprocess.run([sys.executable, "-m", "convgpu.cli.main", "status", "--json", "--run-dir", RUN_DIR],
                           capture_output=True, text=True, timeout=60, cwd="/")
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    def start(self, name, cvd, *steps):
        (self.base / name).mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES")}
        if cvd is not None:
            env["CUDA_VISIBLE_DEVICES"] = cvd
        p = subprocess.Popen(["/bin/sh", "-c", f'echo $$ > {self.base / name}/cgroup.procs && exec "$0" "$@"',
                              sys.executable, "-c", SCRIPT, *steps],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd="/")
        self.procs.append(p)
        out = []
        lines_until(p.stdout, lambda line: line.startswith("{"), out, 120, name)
        return p, json.loads(out[-1])

    def close(self, scenario):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        self.p.terminate()
        self.p.wait(timeout=60)
        self.log += self.p.stderr.read().splitlines()
        record(scenario, log=self.log)
        for d in sorted(self.base.glob("*")) + [self.base]:
            try:
                d.rmdir()
            except OSError:
                pass


def container(st, name):
    return next(c for c in st["containers"] if c["name"].endswith(name) or name in c["cgroup"])


def mapping(st, pid):
    return next(m for m in st["gpu_mappings"] if m["pid"] == pid)


@pytest.fixture
def cg_base(root):
    from convgpu.enforcer.tenants.containers import cgroup_layout
    lay = cgroup_layout()
    need(lay.v2_root is not None, "no cgroup2")
    return Path(lay.v2_root) / f"convgpu-gpu-map-{os.getpid()}"


def test_uuid_form_maps_to_gpu_0_and_empty_sees_none(cg_base):
    nvml, gs = gpus()
    enf = Enforcer(cg_base)
    try:
        p, me = enf.start("byuuid", gs[0].uuid, "0:123")
        record("gpumap uuid", proc=me, minor=gs[0].minor)
        assert (me["init"], me["count"], me["uuids"]) == (0, 1, [gs[0].uuid])
        # the driver opened GPU 0's node at cuInit, before any context (what the mapping reads)
        assert f"/dev/nvidia{gs[0].minor}" in me["nodes_at_init"]
        time.sleep(1.5)
        st = enf.status()
        m = mapping(st, me["pid"])
        assert (m["hosts"], m["certain"], m["also"]) == ([0], True, []), m
        assert st["gpus"]["0"]["uuid"] == gs[0].uuid
        c = container(st, "byuuid")
        assert set(c["gpus"]) == {"0"} and c["gpus"]["0"]["used"] == 124 * MiB   # 2 MiB pages
        assert (me["pid"], 0) in nvml.process_memory()                           # NVML agrees

        q, none = enf.start("empty", "")  # no steps: it only starts CUDA
        record("gpumap empty", proc=none)
        assert none["count"] in (0, -1) and none["uuids"] == []   # 100 from cuInit, or count 0
        assert none["init"] in (0, 100)
        time.sleep(1.5)
        st = enf.status()
        assert not any("empty" in c["cgroup"] for c in st["containers"])     # nothing charged
        assert none["pid"] not in {m["pid"] for m in st["gpu_mappings"]}
        assert not [k for k in nvml.process_memory() if k[0] == none["pid"]]
    finally:
        enf.close("gpumap one gpu")


def test_trace_json_names_the_host_gpu_and_its_uuid():
    nvml, gs = gpus()
    tr = subprocess.Popen([sys.executable, "-m", "convgpu.cli.main", "trace", "--json", "--interval", "0.5",
                           "--demo", "never", "--run-dir", RUN_DIR + "-none"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/")
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    env["CUDA_VISIBLE_DEVICES"] = gs[-1].uuid
    p = None
    try:
        json.loads(tr.stdout.readline())
        p = subprocess.Popen([sys.executable, "-c", SCRIPT, "0:64"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env=env, cwd="/")
        me = json.loads(p.stdout.readline())
        allocs = []
        deadline = time.monotonic() + 30
        while not allocs and time.monotonic() < deadline:
            d = json.loads(tr.stdout.readline())
            if d.get("type") == "event" and d["pid"] == me["pid"] and d["op"] == "alloc":
                allocs.append(d)
        record("gpumap trace", proc=me, allocs=allocs)
        assert [(a["dev"], a["gpu_uuid"], a["size"]) for a in allocs] == [(gs[-1].index, gs[-1].uuid, 64 * MiB)]
    finally:
        for x in (p, tr):
            if x is not None and x.poll() is None:
                x.kill()
                x.wait()


def test_two_gpus_cvd_1_on_gpu_1_and_reversed(cg_base):
    nvml, gs = gpus()
    if len(gs) < 2:   # the hardware, not the set-up: a skip that says so, also under CONVGPU_REQUIRE_SYSTEM
        pytest.skip(f"needs two GPUs, this host has {len(gs)}")
    enf = Enforcer(cg_base)
    try:
        p, one = enf.start("one", "1", "0:256")
        assert one["uuids"] == [gs[1].uuid]
        r, rev = enf.start("rev", "1,0", "0:64", "1:128")
        assert rev["uuids"] == [gs[1].uuid, gs[0].uuid]
        time.sleep(1.5)
        st = enf.status()
        record("gpumap two gpus", one=one, rev=rev, status=st)
        assert (mapping(st, one["pid"])["hosts"], mapping(st, one["pid"])["certain"]) == ([1], True)
        c = container(st, "one")
        assert set(c["gpus"]) == {"1"} and c["gpus"]["1"]["used"] == 256 * MiB   # GPU 0 untouched
        assert (mapping(st, rev["pid"])["hosts"], mapping(st, rev["pid"])["certain"]) == ([1, 0], True)
        c = container(st, "rev")
        assert c["gpus"]["1"]["used"] == 64 * MiB and c["gpus"]["0"]["used"] == 128 * MiB
        listed = nvml.process_memory()
        assert (one["pid"], 1) in listed and (one["pid"], 0) not in listed
    finally:
        enf.close("gpumap two gpus")
