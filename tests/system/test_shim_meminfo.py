"""Issue 18: under the preload shim, a framework that sizes itself from the memory it is told
fits inside its limit, context included (enforcer/serving/memview.py). total = limit - the process's
context, used = the container's bytes and its other processes' contexts; an unmeasured context
counts at the device's ceiling, a measured one as NVML measured it. cuMemGetInfo_v2 and NVML's
memory queries answer alike. In-process enforcer on the stand-in driver (real probes, real
cgroups); the stand-in's per-process slots play NVML's per-process memory and count each
context's CONVGPU_STANDIN_CTX_OVERHEAD, as the real driver's contexts count."""
import json
import os
import subprocess
import sys
import threading
import time

import pytest

from conftest import (GiB, MiB, StandinNvml, inprocess_enforcer, lines_until, run_dir_for, serving, shim_env,
                      until)
from convgpu.enforcer import ctxest

pytestmark = pytest.mark.system
LIMIT = GiB
MEASURED = 120 * MiB   # a bare context measured at start on this device, kept in the state dir
ESTIMATE = 128 * MiB   # what admission charges a fresh context: 120 + 1/16, in 2 MiB pages
CEILING = 144 * MiB    # what a reported total leaves: 128 + 1/8
CTX = 136 * MiB        # the stand-in's real context: above the estimate, as a framework's can be

# A process under the shim, driven line by line: "ctx" makes its context, "info" prints what
# cuMemGetInfo_v2 and NVML (both versions) say, "alloc N" allocates N bytes, "frac F" allocates
# F of the total cuMemGetInfo reports (as JAX's preallocation), "free" all of the free (as
# TensorFlow). Every answer is one JSON line.
WORKER = r"""
import ctypes, json, sys
import pynvml
cu = ctypes.CDLL(sys.argv[1])
pynvml.nvmlInit(); h = pynvml.nvmlDeviceGetHandleByIndex(0)
def info():
    out = {}
    f, t = ctypes.c_size_t(), ctypes.c_size_t()
    if ctx:
        assert cu.cuMemGetInfo_v2(ctypes.byref(f), ctypes.byref(t)) == 0
        out["cuda"] = [t.value, f.value]
    m = pynvml.nvmlDeviceGetMemoryInfo(h); v = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
    out["nvml"] = [m.total, m.free, m.used]
    out["nvml_v2"] = [v.total, v.free, v.used]
    return out
ctx = False
for line in sys.stdin:
    cmd, *arg = line.split()
    if cmd == "ctx":
        d, c = ctypes.c_int(), ctypes.c_void_p()
        cu.cuInit(0); cu.cuDeviceGet(ctypes.byref(d), 0)
        assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(c), d) == 0 and cu.cuCtxSetCurrent(c) == 0
        ctx = True
        print(json.dumps({}), flush=True)
    elif cmd == "info":
        print(json.dumps(info()), flush=True)
    else:
        t = info()["cuda"]
        n = int(t[0] * float(arg[0])) if cmd == "frac" else t[1] if cmd == "free" else int(arg[0])
        p = ctypes.c_ulonglong()
        print(json.dumps({"size": n, "rc": cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(n))}), flush=True)
"""


class GatedNvml(StandinNvml):
    """NVML that has not listed any process yet until the test opens the gate: the estimate
    stays in force for as long as the test needs it, as on a card where NVML lags."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.gate = threading.Event()

    def process_memory(self):
        return super().process_memory() if self.gate.is_set() else {}


class Worker:
    def __init__(self, cg, build, env):
        self.p = subprocess.Popen(["/bin/sh", "-c", f'echo $$ > {cg}/cgroup.procs && exec "$0" "$@"', sys.executable,
                                   "-c", WORKER, str(build / "standin" / "libcuda.so.1")],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env=env)
        self.pid = self.p.pid

    def __call__(self, cmd: str) -> dict:
        self.p.stdin.write(cmd + "\n")
        self.p.stdin.flush()
        try:
            return json.loads(lines_until(self.p.stdout, lambda line: True, [], 30, f"worker {cmd!r}"))
        except AssertionError as e:
            raise AssertionError(f"{e}: {self.p.stderr.read() if self.p.poll() is not None else ''}") from None


def agreed(info: dict) -> tuple[int, int]:
    """(total, free) that every query gave alike: CUDA (if asked), NVML and NVML v2, whose
    used is the total less the free."""
    t, f, u = info["nvml"]
    assert info["nvml_v2"] == [t, f, u] and u == t - f, info
    if "cuda" in info:
        assert info["cuda"] == [t, f], info
    return t, f


@pytest.fixture
def standin(root, build, caller_env):
    """(enforcer, nvml, env, usage): every limit 1 GiB, the card 4 GiB, the measurement above
    in its state dir; the stand-in's contexts cost CTX."""
    env = dict(caller_env, CONVGPU_STANDIN_CAPACITY=str(16 * GiB), CONVGPU_STANDIN_CTX_OVERHEAD=str(CTX),
               CONVGPU_STANDIN_SHM=f"/convgpu-meminfo-{os.getpid()}-{time.monotonic_ns()}")
    state = run_dir_for("meminfo-state")
    with open(os.path.join(state, ctxest.STATE_FILE), "w") as f:
        json.dump({"version": 2, "measured": {ctxest.Device(0).model_key: MEASURED}}, f)
    nvml = GatedNvml(env["CONVGPU_STANDIN_SHM"])
    enf = inprocess_enforcer(build / "standin" / "libcuda.so.1", "meminfo", LIMIT, nvml=nvml, state_dir=state,
                             ctx_overhead=None)

    def usage():
        r = subprocess.run([str(build / "standin" / "standin-usage"), "--json"], env=env, capture_output=True,
                           text=True, check=True)
        return json.loads(r.stdout)["devices"][0]
    yield enf, nvml, shim_env(env, enf, LD_LIBRARY_PATH=f"{build}/standin-nvml:{env['LD_LIBRARY_PATH']}"), usage
    subprocess.run([str(build / "standin" / "standin-usage"), "--unlink"], env=env, capture_output=True)


def test_75_percent_of_the_total_and_then_all_of_the_free_fit_with_their_contexts(standin, build, cgroups):
    """JAX's default (75 % of the total) in one process, then TensorFlow's (all of the free) in a
    second process of the same container, both before NVML measured anything: the container's
    peak on the card, contexts included, stays within its 1 GiB limit. (Before, the total was
    the limit: 768 MiB + 32 MiB + two 136 MiB contexts = 1072 MiB.)"""
    enf, nvml, env, usage = standin
    cg = cgroups("frameworks")
    procs = []
    try:
        with serving(enf):
            st = enf.status()
            assert st["gpus"]["0"]["ctx_estimate"]["bytes"] == ESTIMATE
            assert (st["shim_ctx_ceiling"]["0"]["bytes"], st["shim_ctx_ceiling"]["0"]["source"]) == \
                (CEILING, "estimate")
            a = Worker(cg, build, env)
            procs.append(a)
            a("ctx")
            assert agreed(a("info")) == (LIMIT - CEILING, LIMIT - CEILING)         # 880 MiB, none used
            took = a("frac 0.75")
            assert took == {"size": 660 * MiB, "rc": 0}
            b = Worker(cg, build, env)
            procs.append(b)
            b("ctx")
            # b's total leaves its own context; a's context counts at the ceiling in what is used
            assert agreed(b("info")) == (LIMIT - CEILING, LIMIT - CEILING - 660 * MiB - CEILING)
            assert b("free") == {"size": 76 * MiB, "rc": 0}
            assert agreed(a("info")) == (LIMIT - CEILING, 0)
            row = enf.status()["containers"][0]["gpus"]["0"]
            assert (row["used"], row["contexts"], row["context_source"]) == (736 * MiB, 2, "measured-at-start")
            peak = usage()["peak"]
            assert peak == 660 * MiB + 76 * MiB + 2 * CTX == 1008 * MiB and peak <= LIMIT
            assert not nvml.gate.is_set()      # all of it before NVML measured a thing
    finally:
        for w in procs:
            w.p.kill()
            w.p.wait()


def test_nvml_and_cuda_agree_and_a_total_read_early_is_not_larger_than_later(standin, build, cgroups):
    """NVML before the process has a context (as nvidia-smi) counts the one it will need, so it
    agrees with cuMemGetInfo after; each later answer agrees between CUDA and NVML; and once NVML
    has measured the context (136 MiB, under the 144 MiB ceiling) the total grows to the limit
    less the measurement, never shrinks."""
    enf, nvml, env, usage = standin
    cg = cgroups("queries")
    w = None
    try:
        with serving(enf):
            w = Worker(cg, build, env)
            early = agreed(w("info"))                       # NVML only: no context yet
            assert early == (LIMIT - CEILING, LIMIT - CEILING)
            w("ctx")
            assert agreed(w("info")) == early               # CUDA too, the context now made
            assert w("alloc 100000000") == {"size": 100_000_000, "rc": 0}
            before = agreed(w("info"))
            # charged as BPF charges it: whole 2 MiB pages above 1 MiB (96 MiB = 48 pages)
            assert before == (LIMIT - CEILING, LIMIT - CEILING - 96 * MiB)
            nvml.gate.set()
            until(lambda: enf.status()["containers"][0]["gpus"]["0"]["context_source"] == "measured", 10,
                  "NVML never measured the context")
            after = agreed(w("info"))
            assert after == (LIMIT - CTX, LIMIT - CTX - 96 * MiB)
            assert before[0] <= after[0]
            row = enf.status()["containers"][0]["gpus"]["0"]
            assert row["context_overhead"] == CTX and after[0] == LIMIT - row["context_overhead"]
    finally:
        if w:
            w.p.kill()
            w.p.wait()
