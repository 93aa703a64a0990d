"""What a ptrace-seized workload asks of its tracer (issue 32). The enforcer's holder
(enforcer/failsafe/threadhold.py) seizes every thread of a CUDA process at a stop, polls them
every 0.5 ms, and lets them go 0.5 s after its last hold. On the H100 a seized no-caching
PyTorch workload paid about 28 us a pair during that linger (bench.breakdown, 2026-11-27), and
crawled, past 100 s for 4,000 pairs, when the holder answered every 16 ms: its pairs needed the
tracer. This says for what: every stop of the seized block, by kind, per pair.

    python -m bench.seized [--standin] [--workload torch|cupy|driver|runtime] [--pairs N]
        [--poll-ms 0.5] [--signals K] [--json FILE]

The workload (bench/breakdown_child.py, its driver as bench.breakdown picks it) makes a block
of pairs bare, the same block with every thread seized (PTRACE_SEIZE with PTRACE_O_TRACECLONE,
as the holder seizes) and each stop answered by one thread of this process polling every
--poll-ms, then a bare block again. Nothing else is attached: no probes, no enforcer.
--signals K: the method's check, K SIGWINCH sent to the seized workload before its block, one
at a time (each is a signal-delivery-stop, passed on and ignored): counted as exactly K."""
import argparse
import errno
import json
import os
import shutil
import signal
import sys
import threading
import time

from convgpu.enforcer.failsafe import threadhold as th

from bench.breakdown import Workload, workload_env
from bench.machine import machine


def kind_of(st: int) -> str:
    """A waitpid status of a seized thread, as a kind of stop."""
    if os.WIFEXITED(st) or os.WIFSIGNALED(st):
        return "exit"
    sig, event = os.WSTOPSIG(st), st >> 16
    if event == th.PTRACE_EVENT_CLONE:
        return "clone"
    if event == th.PTRACE_EVENT_STOP:
        return f"event-stop {signal.Signals(sig).name}"
    return f"signal {signal.Signals(sig).name}" if sig in signal.valid_signals() else f"signal {sig}"


class Seizer:
    """Seizes every thread of pid from a thread of its own (ptrace is per tracer thread), answers
    each stop at once (a signal passed on, every other stop continued), counts them by kind, and
    detaches at stop()."""

    def __init__(self, pid: int, poll_s: float):
        self.pid, self.poll_s = pid, poll_s
        self.stops: dict[str, int] = {}
        self.tids: set[int] = set()
        self.seized = 0
        self._ready, self._done = threading.Event(), threading.Event()
        self.error = ""
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        self._ready.wait(10)
        if self.error:
            raise SystemExit(self.error)

    def _run(self):
        for tid in sorted(th._tids(self.pid)):
            err = th.ptrace(th.PTRACE_SEIZE, tid, 0, th.PTRACE_O_TRACECLONE)
            if err and err != errno.ESRCH:   # a thread gone meanwhile: not an error
                self.error = f"PTRACE_SEIZE of thread {tid}: {os.strerror(err)}"
                self._ready.set()
                return
            if not err:
                self.tids.add(tid)
        self.seized = len(self.tids)
        self._ready.set()
        while not self._done.is_set():
            self._answer()
            time.sleep(self.poll_s)
        for tid in self.tids:   # DETACH needs a ptrace-stop: at its trap
            th.ptrace(th.PTRACE_INTERRUPT, tid)
        deadline = time.monotonic() + 5
        while self.tids and time.monotonic() < deadline:
            self._answer(detach=True)
            time.sleep(0.001)

    def _answer(self, detach: bool = False):
        for tid in list(self.tids):
            st = th._wait(tid)
            if st is None:
                continue
            if st == -1 or os.WIFEXITED(st) or os.WIFSIGNALED(st):
                self.tids.discard(tid)
                continue
            event, sig = st >> 16, os.WSTOPSIG(st)
            passed = sig if not event else 0   # a signal-delivery-stop: the signal goes on
            if event == th.PTRACE_EVENT_CLONE:
                self.tids.add(th._event_msg(tid))
            if detach and event == th.PTRACE_EVENT_STOP and sig == signal.SIGTRAP:
                th.ptrace(th.PTRACE_DETACH, tid, 0, 0)   # our INTERRUPT
                self.tids.discard(tid)
                continue
            k = kind_of(st)
            self.stops[k] = self.stops.get(k, 0) + 1
            th.ptrace(th.PTRACE_CONT, tid, 0, passed)

    def stop(self):
        self._done.set()
        self._t.join(10)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--standin", action="store_true")
    ap.add_argument("--workload", choices=("torch", "cupy", "driver", "runtime"),
                    help="default: driver (torch without --standin)")
    ap.add_argument("--pairs", type=int, default=4000)
    ap.add_argument("--poll-ms", type=float, default=0.5, help="the tracer's poll (the holder's: 0.5)")
    ap.add_argument("--signals", type=int, default=0, help="SIGWINCH sent while seized (the count's check)")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    kind = a.workload or ("driver" if a.standin else "torch")
    env, _, _, standin = workload_env(a.standin)
    w = Workload(kind, env)
    try:
        threads = len(th._tids(w.pid))
        bare1 = w.block(a.pairs)
        s = Seizer(w.pid, a.poll_ms / 1000)
        for _ in range(a.signals):   # apart: two pending at once would be delivered once
            os.kill(w.pid, signal.SIGWINCH)
            time.sleep(3 * a.poll_ms / 1000 + 0.005)
        seized = w.block(a.pairs)
        s.stop()
        bare2 = w.block(a.pairs)
    finally:
        w.close()
        if standin:
            shutil.rmtree(standin, ignore_errors=True)
    bare_ns = (bare1[0] + bare2[0]) / 2 / a.pairs
    res = {"workload": kind, "standin": a.standin, "pairs": a.pairs, "poll_ms": a.poll_ms, "signals": a.signals,
           "threads": threads,
           "seized_threads": s.seized, "bare_ns_per_pair": bare_ns,
           "seized_ns_per_pair": seized[0] / a.pairs, "stops": s.stops,
           "stops_per_pair": {k: v / a.pairs for k, v in s.stops.items()}, "machine": machine()}
    print(f"{kind} workload, {threads} threads ({s.seized} seized), {a.pairs} pairs a block; "
          f"the tracer polls every {a.poll_ms} ms")
    print(f"bare {bare_ns / 1000:.2f} us a pair; seized {res['seized_ns_per_pair'] / 1000:.2f} us "
          f"({res['seized_ns_per_pair'] / bare_ns:.2f}x)")
    print("stops while seized: " + (", ".join(f"{k} {v} ({v / a.pairs:.3f} a pair)" for k, v in
                                             sorted(s.stops.items(), key=lambda kv: -kv[1])) or "none"))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
