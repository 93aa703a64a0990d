"""The stand-in NVML never waits on a stopped tenant. A process stopped inside the stand-in
driver's critical section (a SIGSTOP hold of the whole process, a frozen cgroup) keeps the
shared segment's lock while it is stopped. The stand-in NVML used to wait for that lock, and
a restarted enforcer's start (NVML's memory info) waited the whole --handover: its watchdog
then resumed the held calls unchecked (the --handover torture, seeds 56 and 65: 'books over the
limit', one block over in every container). The real NVML asks the kernel; the stand-in now
reads the figures as they stand after 50 ms."""
import os
import subprocess
import sys
import time

import pytest

from conftest import StandinNvml, lines_until

pytestmark = pytest.mark.system
LOCKER = r"""
import ctypes, mmap, os, signal, sys
fd = os.open(sys.argv[1], os.O_RDWR)
seg = mmap.mmap(fd, 0)
addr = ctypes.addressof(ctypes.c_char.from_buffer(seg, 288))   # the segment's mutex (standin_shm.h)
assert ctypes.CDLL(None).pthread_mutex_lock(ctypes.c_void_p(addr)) == 0
print("locked", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)
"""
READER = r"""
import ctypes, sys
nv = ctypes.CDLL(sys.argv[1])
h, m = ctypes.c_void_p(), (ctypes.c_ulonglong * 3)()
assert nv.nvmlInit_v2() == 0 and nv.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(h)) == 0
assert nv.nvmlDeviceGetMemoryInfo(h, m) == 0
print(m[2], flush=True)   # total, free, used
"""


def test_memory_info_is_read_while_a_stopped_process_holds_the_segment_lock(build):
    shm = f"/convgpu-nvmllock-{os.getpid()}-{time.monotonic_ns()}"
    env = dict(os.environ, LD_LIBRARY_PATH=str(build / "standin"), CONVGPU_STANDIN_SHM=shm,
               CONVGPU_STANDIN_NVML_PROCS="1")
    holder = subprocess.Popen([str(build / "holder"), "-s", "256M", "-z"], env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    locker = None
    try:
        lines_until(holder.stdout, lambda x: x.startswith("ready"), [], 30, "holder")
        held = sum(StandinNvml(shm).process_memory().values())
        assert held >= 256 << 20, held
        locker = subprocess.Popen([sys.executable, "-c", LOCKER, f"/dev/shm/{shm.lstrip('/')}"],
                                  stdout=subprocess.PIPE, text=True)
        lines_until(locker.stdout, lambda x: x.strip() == "locked", [], 30, "locker")
        deadline = time.monotonic() + 10
        while open(f"/proc/{locker.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "T":
            assert time.monotonic() < deadline, "the locker never stopped"
            time.sleep(0.01)
        r = subprocess.run([sys.executable, "-c", READER, str(build / "standin-nvml" / "libnvidia-ml.so.1")],
                           env=env, capture_output=True, text=True, timeout=20)
        assert r.returncode == 0, r.stderr
        assert int(r.stdout) == held, (r.stdout, held)   # the live holder's bytes, exactly
    finally:
        if locker is not None:
            locker.kill()     # SIGKILL ends a stopped process too; the mutex is robust
            locker.wait()
        holder.kill()
        holder.wait()
        try:
            os.unlink(f"/dev/shm/{shm.lstrip('/')}")
        except FileNotFoundError:
            pass
