"""Issue 46: the stand-in's model of the driver's process checkpoint (tests/standin/README.md,
"Process checkpoint") held against the real driver. build/holder and build/cpctl are linked by
SONAME, so they run here unchanged on the host's libcuda.so.1. Each test asserts what the
stand-in assumes (a failure says which of its choices to change) and records what it saw in
$CONVGPU_GPU_LOG."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import GiB, MiB
from test_gpu import record

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "system"))
from test_standin_checkpoint import (CHECKPOINTED, ILLEGAL_STATE, LOCKED, OOM, OS_ERROR,  # noqa: E402
                                     RUNNING, Cp, Holder)

pytestmark = pytest.mark.gpu

THREADS = r"""
import ctypes, os
def n(): return len(os.listdir("/proc/self/task"))
cu, ctx = ctypes.CDLL("libcuda.so.1"), ctypes.c_void_p()
before = n()
assert cu.cuInit(0) == 0
at_init = n()
assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0 and cu.cuCtxSetCurrent(ctx) == 0
print(before, at_init, n())
"""


@pytest.fixture
def real(build, root):
    """The real driver (no stand-in on the library path); what was started is killed after."""
    env = {k: v for k, v in os.environ.items() if not (k == "LD_LIBRARY_PATH" and "standin" in v)}
    started = []

    def holder(size, count=1, *args):
        h = Holder(build, env, size, count, None, *args, timeout=600)   # 4 GiB filled by the CPU
        started.append(h.p)
        maps = open(f"/proc/{h.pid}/maps").read()
        assert "libcuda.so" in maps and "standin" not in maps, "holder is not on the real driver"
        return h

    def cp():
        c = Cp(build, env)
        started.append(c.p)
        return c

    yield holder, cp
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=30)


def nvml_of(pid):
    from convgpu.probes.nvml import Nvml
    n = Nvml()
    try:
        return n.process_memory().get((pid, 0), 0), n.gpus()[0]
    finally:
        n.close()


def test_gpu_the_drivers_threads_come_with_the_context(build):
    """Driver 580 on the H100 (docs/gpu-runs/2026-12-06b): cuInit starts a thread (1 -> 2) and the
    first context another (-> 3). The stand-in's default (CONVGPU_STANDIN_CP_THREAD=context) starts
    its one thread, the one that serves the checkpoint calls, with the first context: a process
    holds device memory only once it has a context, so a swap always meets that thread either way."""
    r = subprocess.run([sys.executable, "-c", THREADS], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    before, at_init, at_context = map(int, r.stdout.split())
    record("checkpoint_threads", before=before, after_cuinit=at_init, after_context=at_context)
    assert at_init > before and at_context > at_init, (before, at_init, at_context)


def test_gpu_a_holder_swaps_out_and_in(real):
    """As on the stand-in: the lock holds the holder's next call, the checkpoint takes its
    memory off the GPU (NVML: none), restore and unlock bring the bytes back intact, and its
    calls (a kernel launch) run again. The restore thread is one of the holder's own."""
    holder, cp = real
    a, c = holder(1 * GiB, 4), cp()
    before, _ = nvml_of(a.pid)
    rc, tid = c.call("tid", a.pid)
    tasks = os.listdir(f"/proc/{a.pid}/task")
    times = {}
    for op, want in (("lock", (0, LOCKED)), ("checkpoint", (0, CHECKPOINTED))):
        got = c.call(op, a.pid, 5000 if op == "lock" else None, wait=120)
        times[op] = got[2]
        assert got[:2] == want, (op, got)
    while_out, _ = nvml_of(a.pid)
    a.send("check")
    blocked = a.answer(3) is None
    for op, want in (("restore", (0, LOCKED)), ("unlock", (0, RUNNING))):
        got = c.call(op, a.pid, wait=120)
        times[op] = got[2]
        assert got[:2] == want, (op, got)
    answer = a.answer(60)
    launched = a.ask("launch", 60)
    after, _ = nvml_of(a.pid)
    record("checkpoint_round_trip", bytes=a.bytes, nvml_before=before, nvml_checkpointed=while_out, nvml_after=after,
           ms=times, tid=tid, tid_rc=rc, tid_is_a_thread_of_it=str(tid) in tasks, tid_is_main=tid == a.pid,
           check_blocked=blocked, check=answer, launch=launched)
    assert before >= a.bytes and while_out == 0 and after == before
    assert blocked and answer == f"intact crc={a.crc}" and launched == "launched"
    assert rc == 0 and str(tid) in tasks


def test_gpu_a_restore_without_room_is_beyond_saving(real):
    """FACTS.md (2026-12-06): OOM at once and still CHECKPOINTED, then 304 and unlock 401 once
    the room is back, the state still CHECKPOINTED (H100, driver 580: docs/gpu-runs/2026-12-06b),
    and the holder never answers: the stand-in does the same."""
    holder, cp = real
    a, c = holder(4 * GiB), cp()
    assert c.call("lock", a.pid, 5000)[:2] == (0, LOCKED)
    assert c.call("checkpoint", a.pid, wait=120)[:2] == (0, CHECKPOINTED)
    _, gpu = nvml_of(a.pid)
    b = holder(max(gpu.total - gpu.used - 1536 * MiB, 64 * MiB), 1, "-z")    # leaves 1.5 GiB: too little
    first = c.call("restore", a.pid, wait=120)
    b.p.stdin.close()
    b.p.wait(timeout=60)
    time.sleep(2)
    second = c.call("restore", a.pid, wait=120)
    unlock = c.call("unlock", a.pid, wait=120)
    a.send("check")
    answered = a.answer(5)
    record("checkpoint_restore_without_room", first=first, second=second, unlock=unlock, holder_answered=answered)
    assert first[:2] == (OOM, CHECKPOINTED)
    assert second[:2] == (OS_ERROR, CHECKPOINTED) and unlock[:2] == (ILLEGAL_STATE, CHECKPOINTED)
    assert answered is None
