"""An exit gives its container's memory back at once, but the driver frees the process's own
device memory only when the kernel closes its files (do_exit: the exit tracepoint, then
exit_mm, then exit_files). The enforcer holds those bytes against the card's physical room
until the process's pidfd fires: where the card has room for both (a --gpu-memory smaller than
it), the waiter resumes during the teardown; where it has not, only after. The stand-in driver
frees at the same point (its per-process lock drops when the files close), and a 1 GiB host
buffer in the exiting process makes its exit_mm long enough to tell the two apart.
In-process enforcer (in a thread) on the stand-in, real probes, real cgroups."""
import logging
import re
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from conftest import GiB, MiB

sys.path.append(str(Path(__file__).resolve().parents[2]))   # bench/ lives at the repo root (last: the
#                                                             installed convgpu wins over the source folder)
from bench.sched.resume import Worker  # noqa: E402

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


def exit_scenario(lib, env, cgroups, caplog, physical, during, nvml=None) -> int:
    """A (container exita, a 1 GiB host buffer) holds 2 GiB; B (exitb) is stopped before its
    2 GiB; A exits. Asserts when B resumes against A's teardown; returns the bytes held for A."""
    from convgpu.enforcer.daemon import Enforcer
    from convgpu.enforcer.limits import LimitRules
    from convgpu.probes.tracer import Tracer
    caplog.set_level(logging.DEBUG, logger="convgpu.enforcer.daemon")
    # capacity 4 GiB, limits 3 GiB: A is assigned 3 GiB, B the 1 GiB left
    enf = Enforcer(Tracer(libraries=(str(lib),), discover=False), "fifo", {0: 4 * GiB},
                   LimitRules({}, 3 * GiB), ctx_overhead=CTX, physical=physical, nvml=nvml,
                   run_dir=tempfile.mkdtemp(prefix="convgpu-exit-"))
    enf.start()
    done = threading.Event()

    def serve():
        try:
            enf.run(60, on_step=lambda _: done.is_set() and sys.exit())
        except SystemExit:
            pass
    loop = threading.Thread(target=serve, daemon=True)
    loop.start()
    ws = []
    try:
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
        # its call is in flight (stopped between entry and return): NVML's sampler skips it
        assert b.p.pid in enf.tracer.calls_in_flight() and a.p.pid not in enf.tracer.calls_in_flight()
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
        assert enf._tearing(0) == 0 and not enf._exits
        st = enf.status()["gpus"]["0"]
        assert st["physical"] == (physical or {0: 4 * GiB})[0] and st["tearing_down"] == 0
        return int(m.group(1))
    finally:
        for w in ws:
            w.kill()
        done.set()
        loop.join(timeout=10)
        enf.close()
