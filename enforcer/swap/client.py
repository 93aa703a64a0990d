"""The enforcer's side of the checkpoint agent (agent.py): the child is driven from a thread of
its own, one request at a time, since a checkpoint takes seconds (34 s for 44 GiB on an H100)
and a lock of a process that cannot run never returns (FACTS.md); the loop only submits and
collects (a pipe wakes it). Every request has a deadline: past it the child is killed (the next
request starts another) and the answer says so, with the target's state unknown."""
import json
import logging
import os
import queue
import select
import subprocess
import sys
import time
from dataclasses import dataclass

from ...threads import Thread

log = logging.getLogger(__name__)
START_S = 30.0   # s for the child's start (a Python, the driver, cuInit)


def checkpoint_api(driver: str) -> str:
    """"" if the driver exports the checkpoint calls (agent.CALLS), else why not: read in its
    ELF (probes/untrusted.py), as the probes read a driver, without loading it."""
    from ...probes import untrusted
    from .agent import CALLS
    try:
        fd = untrusted.open_in_root("/", driver)
        try:
            untrusted.check(fd)
            missing = set(CALLS) - set(untrusted.read_symbols(fd, list(CALLS)))
        finally:
            untrusted.close(fd)
    except (OSError, untrusted.Refused) as e:
        return f"cannot read {driver} ({e})"
    return (f"the driver has no checkpoint API ({', '.join(sorted(missing))} missing: one older than CUDA "
            "12.8's)") if missing else ""


@dataclass
class Result:
    op: str
    pid: int
    rc: int | None          # CUresult; None: no answer (the deadline, or no agent)
    state: int = -1         # CUprocessState after it; -1 unknown
    s: float = 0.0
    why: str = ""


class Agent:
    """driver: the host's own libcuda (a path the enforcer trusts); env: the child's
    environment (the stand-in's segment in tests); exempt(pid, on): the enforcer's own pids
    (the backstop and admission leave them alone)."""

    def __init__(self, driver: str, env: dict | None = None, exempt=lambda pid, on: None):
        self.driver, self.env, self.exempt = driver, dict(os.environ if env is None else env), exempt
        self.env.pop("LD_PRELOAD", None)     # the preload shim would ask the enforcer
        self.child: subprocess.Popen | None = None
        self.off = ""                        # why the driver cannot checkpoint ("": it can, or not tried)
        self._todo: queue.SimpleQueue = queue.SimpleQueue()
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        self.pending = 0
        self._thread = Thread(target=self._run, name="convgpu-swap", daemon=True)
        self._thread.start()

    def fileno(self) -> int:
        return self._r

    def submit(self, op: str, pid: int, deadline_s: float, timeout_ms: int = 0):
        self.pending += 1
        self._todo.put((op, pid, deadline_s, timeout_ms))

    def results(self) -> list[Result]:
        try:
            while os.read(self._r, 4096):
                pass
        except BlockingIOError:
            pass
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                break
        self.pending -= len(out)
        return out

    def pid(self) -> int | None:
        c = self.child
        return c.pid if c is not None and c.poll() is None else None

    def close(self):
        self._todo.put(None)
        self._kill()

    # ---- the agent's thread ----
    def _run(self):
        while True:
            req = self._todo.get()
            if req is None:
                return
            op, pid, deadline_s, timeout_ms = req
            try:
                r = self._ask(op, pid, deadline_s, timeout_ms)
            except Exception as e:   # never let the thread die with requests queued
                r = Result(op, pid, None, why=f"{type(e).__name__}: {e}")
            self._done.put(r)
            os.write(self._w, b"x")

    def _ask(self, op: str, pid: int, deadline_s: float, timeout_ms: int) -> Result:
        if not self._ensure():
            return Result(op, pid, None, why=self.off)
        c = self.child
        t0 = time.monotonic()
        c.stdin.write(json.dumps({"op": op, "pid": pid, "timeout_ms": timeout_ms}) + "\n")
        c.stdin.flush()
        line = self._line(deadline_s)
        if not line:
            self._kill()
            return Result(op, pid, None, s=round(time.monotonic() - t0, 3),
                          why=f"the driver did not answer {op} within {deadline_s:g} s")
        got = json.loads(line)
        return Result(op, pid, got.get("rc"), got.get("state", -1), got.get("s", 0.0), got.get("error", ""))

    def _ensure(self) -> bool:
        if self.child is not None and self.child.poll() is None:
            return True
        self.child = subprocess.Popen([sys.executable, "-m", "convgpu.enforcer.swap.agent", self.driver],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                      text=True, env=self.env, cwd="/")
        self.exempt(self.child.pid, True)
        line = self._line(START_S)
        try:
            ready = json.loads(line) if line else {"ready": False, "why": f"no answer within {START_S:g} s"}
        except ValueError:
            ready = {"ready": False, "why": line[:200]}
        if not ready.get("ready"):
            self.off = ready.get("why", "the agent failed")
            self._kill()
            return False
        self.off = ""
        return True

    def _line(self, timeout: float) -> str:
        c = self.child
        if c is None or not select.select([c.stdout], [], [], timeout)[0]:
            return ""
        return c.stdout.readline().strip()

    def _kill(self):
        c, self.child = self.child, None
        if c is None:
            return
        self.exempt(c.pid, False)
        try:
            c.kill()
            c.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            pass
