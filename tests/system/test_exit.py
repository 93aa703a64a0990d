"""An exit gives its container's memory back at once, but the driver frees the process's own
device memory only when the kernel closes its files (do_exit: the exit tracepoint, then
exit_mm, then exit_files). The enforcer holds those bytes against the card's physical room
until the process's pidfd fires: where the card has room for both (a --gpu-memory smaller than
it), the waiter resumes during the teardown; where it has not, only after. The stand-in driver
frees at the same point (its per-process lock drops when the files close), and a 1 GiB host
buffer in the exiting process makes its exit_mm long enough to tell the two apart.
In-process enforcer (in a thread) on the stand-in, real probes, real cgroups."""
import ctypes as ct
import logging
import mmap
import os
import re
import struct
import sys
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

from conftest import GiB, MiB, inprocess_enforcer, serving, until

sys.path.append(str(Path(__file__).resolve().parents[2]))   # bench/ lives at the repo root (last: the
#                                                             installed convgpu wins over the source folder)
from bench.sched.resume import Worker  # noqa: E402
from convgpu.probes.tracer import SETTLE_NS  # noqa: E402

pytestmark = pytest.mark.system
CTX = 64 * MiB


def stamp(caplog, pattern: str, after: int = 0) -> int:
    """t= of the first debug line matching pattern stamped after `after`; waits for it (the
    enforcer's thread logs a resume after the SIGCONT, so the waiter may run first)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        for r in list(caplog.records):
            if (m := re.search(pattern + r".*\(t=(\d+)\)", r.getMessage())) and int(m.group(1)) > after:
                return int(m.group(1))
        time.sleep(0.01)
    raise AssertionError(f"never logged {pattern!r}: {[r.getMessage() for r in caplog.records][-20:]}")


@pytest.mark.parametrize("physical, during", [(None, False), (16 * GiB, True)],
                         ids=["card-full-after-teardown", "card-has-room-during-teardown"])
def test_an_exit_resumes_the_waiter_as_soon_as_the_card_has_room(root, build, cgroups, caller_env, caplog,
                                                                   physical, during):
    held = exit_scenario(build / "standin" / "libcuda.so.1", dict(caller_env, CONVGPU_STANDIN_CAPACITY=str(16 * GiB)),
                         cgroups, caplog, {0: physical} if physical else None, during)
    assert held == 2 * GiB + CTX     # exact: its 2 GiB and one context's charge


@contextmanager
def standin_lock(shm: str):
    """Holds the stand-in driver's process-shared lock (struct si_seg, offset 288): every
    allocation then waits inside the driver, between its entry and its return probe."""
    libc = ct.CDLL(None, use_errno=True)
    fd = os.open(f"/dev/shm/{shm.lstrip('/')}", os.O_RDWR)
    seg = mmap.mmap(fd, 4096)
    mutex = ct.addressof(ct.c_char.from_buffer(seg, 288))
    assert libc.pthread_mutex_lock(ct.c_void_p(mutex)) == 0
    try:
        yield
    finally:
        libc.pthread_mutex_unlock(ct.c_void_p(mutex))
        os.close(fd)    # seg stays mapped while ctypes holds a view of it; it goes with the test process


def test_a_call_running_in_the_driver_is_in_flight(root, build, cgroups, caller_env, tracer):
    """NVML's sampler skips a process whose driver call runs (the driver may count its bytes
    before the call returns): in flight while in the body, not after it returned, except for
    SETTLE_NS after its bytes changed (frees have no return probe)."""
    lib = build / "standin" / "libcuda.so.1"
    w = Worker(cgroups("inflight"), lib, caller_env)
    try:
        with standin_lock(caller_env["CONVGPU_STANDIN_SHM"]):
            w.send(f"a {GiB}")
            until(lambda: w.p.pid in tracer.calls_in_flight(), 5, "the blocked allocation never showed as in flight")
            time.sleep(0.1)
            assert w.p.pid in tracer.calls_in_flight() and w.buf == b""   # still inside it
        w.stamp()
        assert w.p.pid not in tracer.calls_in_flight(settle_ns=0)
        assert w.p.pid in tracer.calls_in_flight()      # its bytes just changed (a free might run)
        time.sleep(SETTLE_NS / 1e9)
        assert w.p.pid not in tracer.calls_in_flight()
    finally:
        w.kill()


SIGNALS = r"""
BPF_RINGBUF_OUTPUT(sent, 64);
TRACEPOINT_PROBE(signal, signal_generate) {
    if (args->sig != 19 && args->sig != 18)
        return 0;
    u64 *r = sent.ringbuf_reserve(3 * sizeof(u64));
    if (!r)
        return 0;
    r[0] = bpf_ktime_get_ns();
    r[1] = args->sig;
    r[2] = ((u64)args->pid << 32) | (bpf_get_current_pid_tgid() >> 32);   // target thread, sender
    sent.ringbuf_submit(r, 0);
    return 0;
}
"""


class Signals:
    """Every SIGSTOP and SIGCONT the kernel generates (signal:signal_generate), stamped like
    BPF's events: to check that BPF stops a process before it tells the enforcer."""

    def __init__(self):
        import bcc
        self.b = bcc.BPF(text=SIGNALS.encode())
        self.seen = []      # (ns, sig, target tid, sender tgid)
        self.b[b"sent"].open_ring_buffer(
            lambda _c, data, _n: self.seen.append(self._decode(ct.string_at(data, 24))))

    @staticmethod
    def _decode(raw: bytes):
        ns, sig, who = struct.unpack("<QQQ", raw)
        return ns, sig, who >> 32, who & 0xFFFFFFFF

    def read(self) -> list:
        self.b.ring_buffer_consume()
        return self.seen

    def __enter__(self):
        return self

    def __exit__(self, *_):
        self.b.cleanup()


def stopped_then_told(signals: list, told: list, pid: int, traced: bool = False):
    """Each stop event of pid (unknown, stall) came after the SIGSTOP its own BPF program sent,
    and before the next one: stop, event, stop, event... A SIGCONT that answered an event can
    therefore never come before the SIGSTOP it undoes. And the last signal it got is a SIGCONT,
    unless its last stop held its thread under ptrace (traced: a process with several threads,
    as the real driver's; issue 23), which PTRACE_CONT ends, no signal sent."""
    stops = [ns for ns, sig, tid, by in signals if sig == 19 and tid == pid and by == pid]
    events = [e.ts_ns for e in told if e.tid == pid]
    assert events and len(stops) == len(events), (pid, stops, events)
    for i, (s, e) in enumerate(zip(stops, events)):
        assert s < e and (i == 0 or events[i - 1] < s), (pid, i, stops, events)
    assert [sig for _, sig, tid, _ in signals if tid == pid][-1] in ((18, 19) if traced else (18,)), (pid, signals)


def exit_scenario(lib, env, cgroups, caplog, physical, during, nvml=None) -> int:
    """A (container exita, a 1 GiB host buffer) holds 2 GiB; B (exitb) is stopped before its
    2 GiB; A exits. Asserts when B resumes against A's teardown, and that each stop reached the
    kernel before its event reached the enforcer; returns the bytes held for A."""
    caplog.set_level(logging.DEBUG, logger="convgpu.enforcer.daemon")
    # capacity 4 GiB, limits 3 GiB: A is assigned 3 GiB, B the 1 GiB left
    enf = inprocess_enforcer(lib, "exit", 3 * GiB, ctx_overhead=CTX, physical=physical, nvml=nvml)
    with ExitStack() as stack:      # unwound in reverse: workers killed, enforcer closed, signals
        signals, told, ws = stack.enter_context(Signals()), [], []
        stack.enter_context(serving(enf, lambda events: told.extend(
            e for e in events if e.op in ("unknown", "stall", "over_limit"))))
        stack.callback(lambda: [w.kill() for w in ws])
        a = Worker(cgroups("exita"), lib, env)
        ws.append(a)
        a.send("h %d" % GiB)
        a.expect("ok")
        a.send(f"a {2 * GiB}")
        a.stamp()
        b = Worker(cgroups("exitb"), lib, env)
        ws.append(b)
        b.send(f"a {2 * GiB}")       # 2 GiB + its context > its 1 GiB: stopped before the call
        b.wait_stopped()
        traced = len(os.listdir(f"/proc/{b.p.pid}/task")) > 1   # its thread held alone (ptrace)
        # stopped at its call's entry, before the body: what the driver counts for it stays put,
        # so NVML's sampler reads it (a waiter whose last value was off is re-read, not frozen)
        assert b.p.pid not in enf.tracer.calls_in_flight(settle_ns=0)
        a.send("x")
        a.stamp()
        b.stamp()                    # B's allocation returned
        a.p.wait(timeout=20)
        exiting = stamp(caplog, rf"pid {a.p.pid} exiting")
        m = re.search(r"exiting, (\d+) bytes held", "".join(
            r.getMessage() for r in caplog.records if f"pid {a.p.pid} exiting" in r.getMessage()))
        resumed = stamp(caplog, rf"resumed exitb pids \[{b.p.pid}\]", after=exiting)
        gone = stamp(caplog, rf"pid {a.p.pid} gone")
        assert (resumed < gone) is during, (exiting, resumed, gone)
        assert enf.books.tearing(0) == 0 and not enf.books.exits
        st = enf.status()["gpus"]["0"]
        assert st["physical"] == (physical or {0: 4 * GiB})[0] and st["tearing_down"] == 0
        seen = signals.read()
        stopped_then_told(seen, told, a.p.pid)      # its first context
        stopped_then_told(seen, told, b.p.pid, traced)   # its first context, then its 2 GiB
        assert [e.op for e in told if e.tid == b.p.pid] == ["unknown", "stall"]
        return int(m.group(1))
