"""A context measured on a GPU model and driver never seen before (issue 31, part 2).

The enforcer starts a short child that loads the host's own driver (a library the tracer
found on the host and trusts, probes/untrusted.py `trusted`: never a file a container
supplies), makes the primary context on one GPU, selected by its UUID (CUDA_VISIBLE_DEVICES;
CUDA ordinals are the process's own, FACTS.md 2026-11-25), and waits while NVML reads its
per-process memory. The child allocates nothing, so all NVML shows for it is its context: on
the H100 and the H200 with driver 580, 518 MiB (FACTS.md). Admission skips the child
(cg_control.measuring: bpf/admit.bpf.c admit()), as it skips the self-test children.

It all runs in a thread of its own: the child's start (a Python and a driver to load, cuInit)
takes a second or more, and an NVML call may hang (a GPU fallen off the bus). The loop only
asks `result()`, which never blocks, and gives up at the deadline: then the child is killed
and the caller falls back (enforcer/ctxest.py choose)."""
import logging
import os
import select
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from ..threads import Thread

log = logging.getLogger(__name__)
TIMEOUT = 20.0     # s for the whole measurement: newcomers on its GPUs wait at most this long
STEADY = 3         # NVML reads in a row that agree: the context is made and has settled
READ_EVERY = 0.05  # s between two NVML reads

_CHILD = r"""
import ctypes, sys
sys.stdin.readline()   # the go: the enforcer exempts this pid from admission first
cu = ctypes.CDLL(sys.argv[1])
d, c = ctypes.c_int(), ctypes.c_void_p()
for what, rc in (("cuInit", lambda: cu.cuInit(0)), ("cuDeviceGet", lambda: cu.cuDeviceGet(ctypes.byref(d), 0)),
                 ("cuDevicePrimaryCtxRetain", lambda: cu.cuDevicePrimaryCtxRetain(ctypes.byref(c), d)),
                 ("cuCtxSetCurrent", lambda: cu.cuCtxSetCurrent(c))):
    err = rc()
    if err:
        print(f"{what} returned CUresult {err}", flush=True)
        sys.exit(2)
print("ready", flush=True)
sys.stdin.readline()   # measured: the context goes with the process
"""


@dataclass(frozen=True)
class Outcome:
    nbytes: int | None     # the bare context, None: not measured
    why: str               # how it was measured, or why not


class Measurement:
    """One context measured on host GPU `dev` (NVML index) in a thread. visible: what selects
    that GPU in CUDA_VISIBLE_DEVICES (its UUID; else its index with PCI_BUS_ID order, which is
    NVML's). exempt(pid, on): admission skips pid from now on, or (on False) no longer, if it
    still does (a late thread must not end the exemption of the next measurement's child)."""

    def __init__(self, model_key: str, dev: int, visible: str, lib: str, nvml, exempt,
                 timeout: float | None = None, env: dict | None = None):
        self.model_key, self.dev, self.visible, self.lib = model_key, dev, visible, lib
        self.nvml, self.exempt = nvml, exempt
        self.started = time.monotonic()
        self.deadline = self.started + (TIMEOUT if timeout is None else timeout)
        self.env = dict(os.environ if env is None else env)
        self.env.pop("LD_PRELOAD", None)       # the preload shim would ask the enforcer: not here
        self.env.update(CUDA_VISIBLE_DEVICES=visible, CUDA_DEVICE_ORDER="PCI_BUS_ID")
        self.child: subprocess.Popen | None = None
        self._outcome: Outcome | None = None
        self._done = threading.Event()
        self._thread = Thread(target=self._run, name=f"convgpu-ctx{dev}", daemon=True)

    def start(self) -> "Measurement":
        self._thread.start()
        return self

    def result(self, now: float | None = None) -> Outcome | None:
        """The outcome, None while it runs; past the deadline a timeout (the child is killed)."""
        if self._done.is_set():
            return self._outcome
        if (now or time.monotonic()) < self.deadline:
            return None
        self._end()
        return Outcome(None, f"no answer within {self.deadline - self.started:g} s (an NVML call or the "
                             "driver hung)")

    def wait(self, timeout: float) -> Outcome | None:
        self._done.wait(timeout)
        return self.result()

    def _run(self):
        try:
            self._outcome = self._measure()
        except Exception as e:   # NVML raised (GPU lost, unknown error), the child could not start
            self._outcome = Outcome(None, f"{type(e).__name__}: {e}")
        finally:
            self._end()
            if self.child is not None:
                self.child.wait()
            self._done.set()

    def _end(self):
        """The child goes, and with it its exemption (from the loop at a timeout, or here)."""
        c = self.child
        if c is None:
            return
        self.exempt(c.pid, False)
        try:
            c.kill()
        except OSError:   # reaped already
            pass

    def _measure(self) -> Outcome:
        self.child = c = subprocess.Popen([sys.executable, "-c", _CHILD, self.lib], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                          env=self.env, cwd="/")
        self.exempt(c.pid, True)
        c.stdin.write("go\n")
        c.stdin.flush()
        line = self._line(c)
        if line != "ready":
            c.kill()
            err = c.stderr.read().strip().splitlines()
            return Outcome(None, f"the child failed: {line or (err[-1] if err else f'exit {c.wait()}')}")
        reads: list[int] = []
        while time.monotonic() < self.deadline:
            n = self.nvml.process_memory().get((c.pid, self.dev), 0)
            reads.append(n)
            if n > 0 and len(reads) >= STEADY and len(set(reads[-STEADY:])) == 1:
                return Outcome(n, f"NVML read {n} bytes for a bare context (pid {c.pid}, {self.lib}, "
                                  f"CUDA_VISIBLE_DEVICES={self.visible}) in {time.monotonic() - self.started:.2f} s")
            time.sleep(READ_EVERY)
        return Outcome(None, "NVML never listed the child's context" if not any(reads) else
                       f"NVML's reading never settled ({reads[-STEADY:]})")

    def _line(self, c) -> str:
        """The child's first line, or "" at the deadline."""
        left = self.deadline - time.monotonic()
        if left <= 0 or not select.select([c.stdout], [], [], left)[0]:
            return ""
        return c.stdout.readline().strip()
