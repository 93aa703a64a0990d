"""Issue 33 rows 1 and 4 on the real driver: `convgpu enforce` as a subprocess, each process in a
cgroup of its own, as nobody where setpriv is there. Row 1: the host's libcuda copied under
another name (and into a memfd) is probed at the process's open of /dev/nvidiactl (the kernel's
device number, NVIDIA's majors from /proc/devices) and stopped at its 1 GiB limit; nvidia-smi and
an NVML poller (nodes opened, no driver mapped) run unstalled. Row 4: the crafted 66 MiB file
named libcuda.so.1 is refused without holding the loop (a neighbour on the real driver is
admitted and stopped at its limit meanwhile). The log of each goes to $CONVGPU_GPU_LOG."""
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import need
from test_gpu_failclosed import ALLOCS, LIMITS, PRELUDE, base, nobody, read  # noqa: F401
from test_gpu_map_quota import Env

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "security"))
from test_row33_4_crafted_elf import crafted  # noqa: E402

pytestmark = pytest.mark.gpu
RENAMED = r"""
import ctypes, os, sys
how, src, d = sys.argv[1], sys.argv[2], sys.argv[3]
data = open(src, "rb").read()
if how == "memfd":
    fd = os.memfd_create("gpu")
    os.write(fd, data)
    path = f"/proc/self/fd/{fd}"
else:
    path = os.path.join(d, "libgpu.so")
    open(path, "wb").write(data)
""" + PRELUDE.replace('ctypes.CDLL("libcuda.so.1")', "ctypes.CDLL(path)") + ALLOCS[len(PRELUDE):]
NVML = r"""
import ctypes, sys
n = ctypes.CDLL("libnvidia-ml.so.1")
for i in range(20):                      # an exporter: init, read, shut down, again
    assert n.nvmlInit_v2() == 0
    c = ctypes.c_uint()
    assert n.nvmlDeviceGetCount_v2(ctypes.byref(c)) == 0
    n.nvmlShutdown()
print('polled', c.value, flush=True)
"""
OPEN = "import os,sys; fd=os.open(sys.argv[1], os.O_RDONLY); print('opened', flush=True); sys.stdin.readline()"
NEIGHBOUR = ALLOCS


def _driver() -> str:
    from convgpu.probes.libs import system_drivers
    found = system_drivers()
    need(bool(found), "no libcuda.so.1 on this host")
    return found[0]


@pytest.mark.parametrize("how", ["copy", "memfd"])
def test_gpu_33_1_the_driver_under_another_name_is_probed_at_its_gpu_open(base, how):
    d = Path(tempfile.mkdtemp(prefix="convgpu-renamed-"))
    os.chmod(d, 0o777)
    e = Env(base, LIMITS)
    try:
        a = e.start("renamed", RENAMED.replace("sys.argv[1], sys.argv[2], sys.argv[3]",
                                               f"{how!r}, {_driver()!r}, {str(d)!r}"), wrap=nobody())
        out = read(a, [], "done", 90)
        # a context charged 600 MiB and a 1 GiB limit: at most one 256 MiB allocation (before: 8)
        assert len([x for x in out if x.startswith("alloc")]) * 256 <= 1024 - 600, out
        assert a.poll() is None
        e.until("exports the driver's entry points under another name: probed before it goes on")
        e.until("above its limit 1.0 GiB")
    finally:
        e.close(f"33.1 renamed driver ({how})")
        shutil.rmtree(d, ignore_errors=True)


def test_gpu_33_1_nvml_only_tools_run_unstalled(base):
    e = Env(base, LIMITS)
    try:
        t0 = time.monotonic()
        p = e.start("exporter", NVML, wrap=nobody())
        assert read(p, [], "polled", 60)[-1].startswith("polled"), "the NVML poller did not finish"
        took = time.monotonic() - t0
        if shutil.which("nvidia-smi"):
            s = e.start("smi", "import subprocess,sys; r=subprocess.run(['nvidia-smi','-L'],capture_output=True,"
                               "text=True,timeout=60); print('smi', r.returncode, flush=True)", wrap=nobody())
            assert read(s, [], "smi", 90)[-1] == "smi 0"
        assert took < 30, took
        assert not [x for x in e.log if "cannot be checked" in x or "opened the GPU and maps" in x], e.log[-20:]
    finally:
        e.close("33.1 NVML only")


def test_gpu_33_4_a_crafted_driver_file_does_not_hold_the_loop(base):
    d = Path(tempfile.mkdtemp(prefix="convgpu-crafted-"))
    os.chmod(d, 0o755)
    lib = d / "libcuda.so.1"
    crafted(lib)
    e = Env(base, (*LIMITS, "--discover"))
    try:
        a = e.start("crafted", OPEN.replace("sys.argv[1]", repr(str(lib))), wrap=nobody())
        e.until("symbol tables, more than the 4 an ELF file may have", 30)
        n = e.start("neighbour", NEIGHBOUR, wrap=nobody())
        out = read(n, [], "done", 90)
        assert len([x for x in out if x.startswith("alloc")]) * 256 <= 1024 - 600, out
        e.until("above its limit 1.0 GiB", 30)
        assert not [x for x in e.log if "the loop has not run" in x or "loop was held" in x], e.log[-20:]
        assert a.poll() is None
    finally:
        e.close("33.4 crafted ELF")
        shutil.rmtree(d, ignore_errors=True)
