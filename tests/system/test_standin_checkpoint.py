"""Issue 46, item 4: the stand-in driver's process checkpoint (cuCheckpointProcess*), as FACTS.md
saw the real driver do it (H100, driver 580.159.04, 2026-12-06). build/holder, as nobody, holds
device memory filled with a pattern of its pid and checks it; build/cpctl, as root, is the
checkpointing process (the enforcer's child will be): it calls cuCheckpointProcessLock,
Checkpoint, Restore and Unlock on the holder by pid, and cuCheckpointProcessGetState after each.
The stand-in's driver thread does the work inside the holder, as the real driver's does, so a
holder stopped whole never answers and one held at its thread by ptrace does. No enforcer, no
probes: real processes, a real memory cgroup, real ptrace."""
import json
import os
import pwd
import queue
import signal
import subprocess
import sys
import time

import pytest

from conftest import MiB, _lines, until

pytestmark = pytest.mark.system
RUNNING, LOCKED, CHECKPOINTED, FAILED = 0, 1, 2, 3         # CUprocessState
INVALID, OOM, NOT_INITIALIZED, OS_ERROR, ILLEGAL_STATE, NOT_READY, NOT_SUPPORTED = 1, 2, 3, 304, 401, 600, 801
CAPACITY = 64 * MiB


class Holder:
    """build/holder -s SIZE -n COUNT as `user`: its pid, bytes and pattern CRC from `ready`."""

    def __init__(self, build, env, size, count, user, *args, timeout=15):
        pw = pwd.getpwnam(user) if user else None
        ids = {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": []} if pw else {}
        self.p = subprocess.Popen([str(build / "holder"), "-s", str(size), "-n", str(count), *args],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env=env, **ids)
        ready = self.answer(timeout)
        assert ready and ready.startswith("ready "), (ready, self.p.stderr.read() if self.p.poll() is not None else "")
        f = dict(kv.split("=") for kv in ready.split()[1:])
        self.pid, self.bytes, self.crc = int(f["pid"]), int(f["bytes"]), f["crc"]
        assert self.pid == self.p.pid and self.bytes == size

    def send(self, line):
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()

    def answer(self, timeout):
        """Its next line, or None if none came within timeout s (a call that blocks)."""
        try:
            line = _lines(self.p.stdout).get(timeout=timeout)
        except queue.Empty:
            return None
        return line.rstrip() if line else None

    def ask(self, line, timeout=10):
        self.send(line)
        return self.answer(timeout)

    def rss(self) -> int:
        with open(f"/proc/{self.pid}/status") as f:
            return next(int(x.split()[1]) * 1024 for x in f if x.startswith("VmRSS:"))


class Cp:
    """build/cpctl: one call a line, its CUresult, the state after it and how long it took."""

    def __init__(self, build, env):
        self.p = subprocess.Popen([str(build / "cpctl")], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=env)

    def call(self, op, pid, timeout_ms=None, wait=40):
        self.p.stdin.write(f"{op} {pid}{'' if timeout_ms is None else f' {timeout_ms}'}\n")
        self.p.stdin.flush()
        line = _lines(self.p.stdout).get(timeout=wait)
        f = dict(kv.split("=") for kv in line.split()[1:])
        assert line.split()[0] == op, line
        if op == "tid":
            return int(f["rc"]), int(f["tid"])
        return int(f["rc"]), int(f["state"]), float(f["ms"])

    def do(self, op, pid, timeout_ms=None):
        """(CUresult, state after), the time left out."""
        return self.call(op, pid, timeout_ms)[:2]


class Stand:
    """A stand-in GPU of its own (a fresh segment, CAPACITY bytes) and what runs on it."""

    def __init__(self, build, tag):
        self.build = build
        self.env = dict(os.environ, LD_LIBRARY_PATH=str(build / "standin"), CONVGPU_STANDIN_CAPACITY=str(CAPACITY),
                        CONVGPU_STANDIN_SHM=f"/convgpu-cp-{os.getpid()}-{tag}-{time.monotonic_ns()}")
        self.procs = []

    def holder(self, size, count=1, user="nobody", **knobs):
        h = Holder(self.build, dict(self.env, **{k: str(v) for k, v in knobs.items()}), size, count, user)
        self.procs.append(h.p)
        return h

    def cp(self, **knobs):
        c = Cp(self.build, dict(self.env, **{k: str(v) for k, v in knobs.items()}))
        self.procs.append(c.p)
        return c

    def usage(self) -> dict:
        out = subprocess.run([str(self.build / "standin" / "standin-usage"), "--json"], env=self.env,
                             capture_output=True, text=True, check=True).stdout
        return json.loads(out)

    def text(self) -> list[str]:
        return subprocess.run([str(self.build / "standin" / "standin-usage")], env=self.env, capture_output=True,
                              text=True, check=True).stdout.splitlines()

    def proc(self, pid):
        """pid's row of standin-usage (None: no slot): used, cp_state, saved on device 0."""
        rows = [p for p in self.usage()["procs"] if p["pid"] == pid]
        return (rows[0]["used"][0], rows[0]["cp_state"], rows[0]["saved"][0]) if rows else None

    def nvml(self) -> dict:
        """{pid: bytes} as the stand-in NVML lists compute processes on GPU 0 (pynvml)."""
        code = ("import pynvml\npynvml.nvmlInit()\nh = pynvml.nvmlDeviceGetHandleByIndex(0)\n"
                "print({p.pid: p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)})\n")
        env = dict(self.env, LD_LIBRARY_PATH=str(self.build / "standin-nvml"), CONVGPU_STANDIN_NVML_PROCS="1")
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        return eval(r.stdout)   # noqa: S307  (a dict of ints printed by the line above)

    def close(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)
        subprocess.run([str(self.build / "standin" / "standin-usage"), "--unlink"], env=self.env, capture_output=True)


@pytest.fixture
def stand(build, root, request):
    s = Stand(build, request.node.name[:40].replace("[", "-").replace("]", ""))
    yield s
    s.close()


def test_lock_holds_the_holders_calls_until_unlock(stand):
    """Lock: RUNNING -> LOCKED, the holder's next call waits at the driver's gate; a call in the
    wrong state is ILLEGAL_STATE and changes nothing; unlock lets the waiting call run."""
    h, cp = stand.holder(8 * MiB), stand.cp()
    assert cp.do("state", h.pid) == (0, RUNNING)
    assert cp.do("lock", h.pid, 1000) == (0, LOCKED)
    h.send("launch")
    assert h.answer(0.5) is None                            # blocked at its entry
    assert cp.do("lock", h.pid, 100) == (ILLEGAL_STATE, LOCKED)
    assert cp.do("restore", h.pid) == (ILLEGAL_STATE, LOCKED)
    assert stand.proc(h.pid) == (8 * MiB, LOCKED, 0)        # locked, still on the device
    assert f"proc pid={h.pid} used={8 * MiB} cp_state={LOCKED}" in stand.text()
    assert cp.do("unlock", h.pid) == (0, RUNNING)
    assert h.answer(5) == "launched"
    assert cp.do("unlock", h.pid) == (ILLEGAL_STATE, RUNNING)
    assert cp.do("checkpoint", h.pid) == (ILLEGAL_STATE, RUNNING)
    assert h.ask("launch") == "launched"


def test_lock_waits_for_the_calls_in_flight(stand):
    """A call inside the driver (a 1.5 s cuMemAlloc_v2, CONVGPU_STANDIN_ALLOC_MS) finishes
    first: a lock whose timeout ends sooner is NOT_READY and leaves RUNNING; a longer one
    returns once the call has."""
    h, cp = stand.holder(4 * MiB, CONVGPU_STANDIN_ALLOC_MS=1500), stand.cp()
    h.send("alloc 1M")
    time.sleep(0.3)
    rc, state, ms = cp.call("lock", h.pid, 200)
    assert (rc, state) == (NOT_READY, RUNNING) and 200 <= ms < 1000, ms
    rc, state, ms = cp.call("lock", h.pid, 10000)
    assert (rc, state) == (0, LOCKED) and ms > 100, ms     # it waited for the allocation
    assert h.answer(5) == f"allocated {MiB}"
    assert stand.proc(h.pid)[:2] == (5 * MiB, LOCKED)
    assert cp.do("unlock", h.pid) == (0, RUNNING)


def test_checkpoint_frees_the_device_and_a_restore_without_room_is_beyond_saving(stand):
    """Checkpoint: the holder's 40 MiB leave the GPU (its slot 0, NVML lists it no more) and
    another process takes them. A restore without the room: OOM at once, still CHECKPOINTED;
    and, as on the real driver (driver 580, docs/gpu-runs/2026-12-06b), beyond saving: the next
    restore is 304, unlock 401, the state still CHECKPOINTED, and the holder's calls never return."""
    a, cp = stand.holder(40 * MiB, CONVGPU_STANDIN_BACKED=1), stand.cp()
    assert stand.nvml() == {a.pid: 40 * MiB}
    assert cp.do("lock", a.pid, 1000) == (0, LOCKED)
    assert cp.do("checkpoint", a.pid) == (0, CHECKPOINTED)
    assert stand.proc(a.pid) == (0, CHECKPOINTED, 40 * MiB)
    assert stand.usage()["devices"][0]["used"] == 0
    assert f"checkpointed pid={a.pid} state={CHECKPOINTED} saved={40 * MiB}" in stand.text()
    assert not [x for x in stand.text() if x.startswith(f"proc pid={a.pid} ")]
    assert stand.nvml() == {}
    b = stand.holder(40 * MiB)                              # the freed capacity, taken
    assert stand.nvml() == {b.pid: 40 * MiB}
    rc, state, ms = cp.call("restore", a.pid)
    assert (rc, state) == (OOM, CHECKPOINTED) and ms < 1000
    assert stand.proc(a.pid) == (0, CHECKPOINTED, 40 * MiB)
    b.p.stdin.close()
    assert b.p.wait(timeout=10) == 0
    assert stand.usage()["devices"][0]["used"] == 0         # the room is back: too late
    assert cp.do("restore", a.pid) == (OS_ERROR, CHECKPOINTED)
    assert cp.do("unlock", a.pid) == (ILLEGAL_STATE, CHECKPOINTED)
    assert cp.do("lock", a.pid, 100) == (ILLEGAL_STATE, CHECKPOINTED)
    assert cp.do("restore", a.pid) == (OS_ERROR, CHECKPOINTED)
    a.send("check")
    assert a.answer(0.5) is None
    assert stand.proc(a.pid) == (0, CHECKPOINTED, 40 * MiB) and stand.usage()["devices"][0]["used"] == 0


def test_restore_with_room_brings_the_bytes_back(stand):
    """Backed device memory (CONVGPU_STANDIN_BACKED=1): the checkpoint copies the contents
    aside and drops the device pages, so only a restore that copies them back reads intact.
    A check made while checkpointed waits, and answers after the unlock."""
    a, cp = stand.holder(24 * MiB, 3, CONVGPU_STANDIN_BACKED=1), stand.cp()
    assert a.ask("check") == f"intact crc={a.crc}"
    assert cp.do("lock", a.pid, 1000) == (0, LOCKED)
    assert cp.do("checkpoint", a.pid) == (0, CHECKPOINTED)
    assert stand.proc(a.pid) == (0, CHECKPOINTED, 24 * MiB)
    a.send("check")
    assert a.answer(0.3) is None
    assert cp.do("restore", a.pid) == (0, LOCKED)
    assert stand.proc(a.pid) == (24 * MiB, LOCKED, 0)
    assert stand.nvml() == {a.pid: 24 * MiB}
    assert a.answer(0.3) is None                            # restored, still locked
    assert cp.do("unlock", a.pid) == (0, RUNNING)
    assert a.answer(5) == f"intact crc={a.crc}"
    assert a.ask("launch") == "launched"
    assert a.ask("alloc 8M") == f"allocated {8 * MiB}"
    assert a.ask("free") == f"freed {32 * MiB}"
    assert stand.proc(a.pid) == (0, RUNNING, 0)


def test_the_host_copy_is_the_holders_memory(stand):
    """The copy lives in the holder (FACTS.md: its RSS and its memory cgroup grew by it): 64 MiB
    checkpointed charge 64 MiB more to its cgroup, given back at the restore."""
    from test_daemon_memory import MemCg
    a, cp = stand.holder(64 * MiB), stand.cp()
    cg = MemCg(f"convgpu-cp-{os.getpid()}-{time.monotonic_ns()}")
    try:
        cg.join(a.pid)
        mem0, rss0 = cg.usage(), a.rss()
        assert cp.do("lock", a.pid, 1000) == (0, LOCKED)
        assert cp.do("checkpoint", a.pid) == (0, CHECKPOINTED)
        grew, rss = cg.usage() - mem0, a.rss() - rss0
        assert 64 * MiB <= grew < 68 * MiB and 64 * MiB <= rss < 68 * MiB, (grew, rss)
        assert cp.do("restore", a.pid) == (0, LOCKED)
        assert cp.do("unlock", a.pid) == (0, RUNNING)
        assert cg.usage() - mem0 < 4 * MiB and a.rss() - rss0 < 4 * MiB
    finally:
        a.p.kill()
        a.p.wait(timeout=10)
        cg.remove()


def test_the_copy_knobs(stand):
    """CONVGPU_STANDIN_CP_HOST_MAX bounds the host bytes touched for a copy (a big stand-in GPU
    on a small CI host); CONVGPU_STANDIN_CP_MS makes a checkpoint and a restore take longer."""
    a, cp = stand.holder(48 * MiB, CONVGPU_STANDIN_CP_HOST_MAX=16 * MiB, CONVGPU_STANDIN_CP_MS=300), stand.cp()
    rss0 = a.rss()
    assert cp.do("lock", a.pid, 1000) == (0, LOCKED)
    rc, state, ms = cp.call("checkpoint", a.pid)
    assert (rc, state) == (0, CHECKPOINTED) and ms >= 300, ms
    assert 16 * MiB <= a.rss() - rss0 < 20 * MiB
    assert stand.proc(a.pid) == (0, CHECKPOINTED, 48 * MiB)
    rc, state, ms = cp.call("restore", a.pid)
    assert (rc, state) == (0, LOCKED) and ms >= 300, ms
    assert cp.do("unlock", a.pid) == (0, RUNNING)


def test_lock_of_a_stopped_holder_is_not_ready_and_leaves_it_running(stand):
    """A holder stopped whole cannot run its driver thread: the lock is NOT_READY at its timeout
    (timeoutMs 0: at CONVGPU_STANDIN_CP_WAIT_MS; the real driver waited for good) and leaves it
    RUNNING; the requests taken back never run after SIGCONT."""
    a, cp = stand.holder(4 * MiB), stand.cp(CONVGPU_STANDIN_CP_WAIT_MS=400)
    os.kill(a.pid, signal.SIGSTOP)
    try:
        until(lambda: open(f"/proc/{a.pid}/stat").read().rsplit(")", 1)[1].split()[0] == "T", 5, "stopped")
        rc, state, ms = cp.call("lock", a.pid, 300)
        assert (rc, state) == (NOT_READY, RUNNING) and 300 <= ms < 1500, ms
        rc, state, ms = cp.call("lock", a.pid)             # NULL args: no timeout of its own
        assert (rc, state) == (NOT_READY, RUNNING) and 400 <= ms < 1600, ms
    finally:
        os.kill(a.pid, signal.SIGCONT)
    time.sleep(0.3)
    assert cp.do("state", a.pid) == (0, RUNNING)
    assert a.ask("launch") == "launched"
    rc, state, ms = cp.call("lock", a.pid, 1000)
    assert (rc, state) == (0, LOCKED) and ms < 500
    assert cp.do("unlock", a.pid) == (0, RUNNING)


def test_a_holder_held_at_its_thread_by_ptrace_is_swapped_out_and_in(stand):
    """Its main thread seized and interrupted (how the enforcer holds a waiter's thread,
    enforcer/failsafe/threadhold.py): the driver thread still runs, so lock, checkpoint, restore
    and unlock all answer, and the bytes are intact after the detach."""
    from convgpu.enforcer.failsafe.threadhold import PTRACE_DETACH, PTRACE_INTERRUPT, PTRACE_SEIZE, WALL, ptrace
    a, cp = stand.holder(16 * MiB, CONVGPU_STANDIN_BACKED=1), stand.cp()
    rc, tid = cp.call("tid", a.pid)
    assert rc == 0 and tid != a.pid and str(tid) in os.listdir(f"/proc/{a.pid}/task")
    assert ptrace(PTRACE_SEIZE, a.pid) == 0
    try:
        assert ptrace(PTRACE_INTERRUPT, a.pid) == 0
        _, status = os.waitpid(a.pid, WALL)
        assert os.WIFSTOPPED(status)
        assert open(f"/proc/{a.pid}/stat").read().rsplit(")", 1)[1].split()[0] == "t"
        assert cp.do("lock", a.pid, 2000) == (0, LOCKED)
        assert cp.do("checkpoint", a.pid) == (0, CHECKPOINTED)
        assert stand.proc(a.pid) == (0, CHECKPOINTED, 16 * MiB)
        assert cp.do("restore", a.pid) == (0, LOCKED)
        assert cp.do("unlock", a.pid) == (0, RUNNING)
    finally:
        assert ptrace(PTRACE_DETACH, a.pid) == 0
    assert a.ask("check") == f"intact crc={a.crc}"


def test_a_holder_that_exits_checkpointed_leaves_nothing(stand):
    """One leaves at EOF (its exit handler gives the slot back), one is SIGKILLed (its slot is
    reaped): neither has a slot, a state or a byte on the device after."""
    a, b, cp = stand.holder(8 * MiB), stand.holder(16 * MiB), stand.cp()
    for h in (a, b):
        assert cp.do("lock", h.pid, 1000) == (0, LOCKED)
        assert cp.do("checkpoint", h.pid) == (0, CHECKPOINTED)
    assert {p["pid"]: (p["cp_state"], p["saved"][0]) for p in stand.usage()["procs"]} == \
        {a.pid: (CHECKPOINTED, 8 * MiB), b.pid: (CHECKPOINTED, 16 * MiB), cp.p.pid: (RUNNING, 0)}
    a.p.stdin.close()
    assert a.p.wait(timeout=10) == 0
    b.p.kill()
    b.p.wait(timeout=10)
    u = stand.usage()
    assert [p["pid"] for p in u["procs"]] == [cp.p.pid] and u["devices"][0]["used"] == 0
    assert cp.do("state", a.pid) == (INVALID, -1)
    assert cp.do("restore", b.pid) == (INVALID, -1)


CALLER = r"""
import ctypes, json, sys
cu = ctypes.CDLL(sys.argv[1])
pid, st, tid = int(sys.argv[2]), ctypes.c_int(-1), ctypes.c_int(0)
o = {"before_init": cu.cuCheckpointProcessGetState(pid, ctypes.byref(st))}
assert cu.cuInit(0) == 0
o["unknown_pid"] = cu.cuCheckpointProcessGetState(0x7ffffff0, ctypes.byref(st))
o["no_pointer"] = cu.cuCheckpointProcessGetState(pid, None)
o["state"] = [cu.cuCheckpointProcessGetState(pid, ctypes.byref(st)), st.value]
lock = (ctypes.c_uint * 16)(100, 1)             # CUcheckpointLockArgs: timeoutMs, reserved0 = 1
o["lock_reserved"] = cu.cuCheckpointProcessLock(pid, lock)
restore = (ctypes.c_uint64 * 8)(8)              # CUcheckpointRestoreArgs.gpuPairs: not NULL
o["restore_pairs"] = cu.cuCheckpointProcessRestore(pid, restore)
o["tid"] = [cu.cuCheckpointProcessGetRestoreThreadId(pid, ctypes.byref(tid)), tid.value]
me, lock = __import__("os").getpid(), (ctypes.c_uint * 16)(200)
o["own_tid_without_context"] = cu.cuCheckpointProcessGetRestoreThreadId(me, ctypes.byref(tid))
o["own_lock_without_context"] = [cu.cuCheckpointProcessLock(me, lock), cu.cuCheckpointProcessGetState(me, ctypes.byref(st)), st.value]
print(json.dumps(o))
"""


def test_the_caller_needs_cuinit_and_a_pid_the_driver_knows(stand, build):
    """A caller must have called cuInit; the target must have a slot. The driver thread comes
    with a process's first context (CONVGPU_STANDIN_CP_THREAD=context): the caller itself, with
    none, has no thread to name and never answers a lock."""
    a = stand.holder(2 * MiB)
    r = subprocess.run([sys.executable, "-c", CALLER, str(build / "standin" / "libcuda.so.1"), str(a.pid)],
                       env=stand.env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    o = json.loads(r.stdout)
    tid = o.pop("tid")
    assert o == {"before_init": NOT_INITIALIZED, "unknown_pid": INVALID, "no_pointer": INVALID,
                 "state": [0, RUNNING], "lock_reserved": INVALID, "restore_pairs": NOT_SUPPORTED,
                 "own_tid_without_context": NOT_READY, "own_lock_without_context": [NOT_READY, 0, RUNNING]}
    assert tid[0] == 0 and tid[1] != a.pid and str(tid[1]) in os.listdir(f"/proc/{a.pid}/task")
    assert a.ask("launch") == "launched"                    # nothing of it ran


SELF = r"""
import ctypes, json, os, struct, sys
from ctypes import byref, c_size_t, c_uint64, c_void_p
MiB = 1 << 20
cu = ctypes.CDLL(sys.argv[1])
assert cu.cuInit(0) == 0
ctx = c_void_p()
assert cu.cuDevicePrimaryCtxRetain(byref(ctx), 0) == 0 and cu.cuCtxSetCurrent(ctx) == 0

def slot():     # this process's bytes in the segment (its own calls wait while it is locked)
    seg = open("/dev/shm/" + os.environ["CONVGPU_STANDIN_SHM"].lstrip("/"), "rb").read()
    return sum(struct.unpack_from("<Q", seg, 352 + 144 * i + 16)[0]
               for i in range(struct.unpack_from("<I", seg, 20)[0])
               if struct.unpack_from("<i", seg, 352 + 144 * i)[0] == os.getpid())

pattern = bytes(range(256)) * (4 * MiB // 256)
want = bytearray(pattern)
want[MiB:MiB + 16] = b"\xab" * 16
d = c_uint64()
assert cu.cuMemAlloc_v2(byref(d), c_size_t(4 * MiB)) == 0
o = {"htod": cu.cuMemcpyHtoD_v2(d, pattern, c_size_t(4 * MiB)),
     "htod_past_end": cu.cuMemcpyHtoD_v2(c_uint64(d.value + 1), pattern, c_size_t(4 * MiB)),
     "memset_inside": cu.cuMemsetD8_v2(c_uint64(d.value + MiB), 0xAB, c_size_t(16)),
     "memset_past_end": cu.cuMemsetD8_v2(c_uint64(d.value + MiB), 0, c_size_t(3 * MiB + 1))}
# VMM: a 2 MiB handle mapped at the start of a 4 MiB reservation
base, h = c_uint64(), c_uint64()
prop = struct.pack("<iiiiQQ", 1, 0, 1, 0, 0, 0)          # PINNED, no handle type, DEVICE 0
access = struct.pack("<iii", 1, 0, 3)                    # DEVICE 0, PROT_READWRITE
assert cu.cuMemAddressReserve(byref(base), c_size_t(4 * MiB), c_size_t(0), c_uint64(0), c_uint64(0)) == 0
assert cu.cuMemCreate(byref(h), c_size_t(2 * MiB), prop, c_uint64(0)) == 0
assert cu.cuMemMap(base, c_size_t(2 * MiB), c_size_t(0), h, c_uint64(0)) == 0
assert cu.cuMemSetAccess(base, c_size_t(2 * MiB), access, c_size_t(1)) == 0
o["dtod_to_mapping"] = cu.cuMemcpyDtoD_v2(base, d, c_size_t(2 * MiB))
o["dtod_past_mapping"] = cu.cuMemcpyDtoD_v2(base, d, c_size_t(2 * MiB + 1))
o["held"] = slot()
pid, lock = os.getpid(), struct.pack("<II7Q", 5000, 0, *[0] * 7)
o["self_checkpoint"] = [cu.cuCheckpointProcessLock(pid, lock), cu.cuCheckpointProcessCheckpoint(pid, None), slot(),
                        cu.cuCheckpointProcessRestore(pid, None), cu.cuCheckpointProcessUnlock(pid, None), slot()]
out = ctypes.create_string_buffer(4 * MiB)
o["dtoh"] = cu.cuMemcpyDtoH_v2(out, d, c_size_t(4 * MiB))
o["linear_intact"] = out.raw == bytes(want)
out = ctypes.create_string_buffer(2 * MiB)
o["dtoh_mapping"] = cu.cuMemcpyDtoH_v2(out, base, c_size_t(2 * MiB))
o["mapping_intact"] = out.raw == bytes(want[:2 * MiB])
o["unmapped"] = [cu.cuMemUnmap(base, c_size_t(2 * MiB)), cu.cuMemRelease(h), slot()]
print(json.dumps(o))
"""


@pytest.mark.parametrize("backed", [1, 0])
def test_copies_and_vmm_contents_through_a_checkpoint_of_itself(stand, build, backed):
    """Copies are bounds-checked against live allocations and mappings either way; only backed
    memory holds bytes, and they survive a process checkpointing itself (linear and VMM)."""
    r = subprocess.run([sys.executable, "-c", SELF, str(build / "standin" / "libcuda.so.1")], timeout=60,
                       env=dict(stand.env, CONVGPU_STANDIN_BACKED=str(backed)), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {
        "htod": 0, "htod_past_end": INVALID, "memset_inside": 0, "memset_past_end": INVALID,
        "dtod_to_mapping": 0, "dtod_past_mapping": INVALID, "held": 6 * MiB,
        "self_checkpoint": [0, 0, 0, 0, 0, 6 * MiB],
        "dtoh": 0, "linear_intact": bool(backed), "dtoh_mapping": 0, "mapping_intact": bool(backed),
        "unmapped": [0, 0, 4 * MiB]}
