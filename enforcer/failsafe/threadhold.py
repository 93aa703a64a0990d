"""Holding one thread, not its process: a call stopped by BPF stops only the thread that made it,
so its siblings keep running and freeing (issue 23, part 3; docs/ENFORCE.md, "Waits").

A stop signal stops a whole thread group (FACTS.md, 2026-11-25: `bpf_send_signal_thread(SIGSTOP)`
too), but a thread that is ptrace-seized enters *signal-delivery-stop* alone, and its tracer
decides whether the signal is ever delivered (man 2 ptrace). So when BPF has stopped a thread of
a process with siblings, the holder seizes every thread of it (PTRACE_SEIZE, PTRACE_O_TRACECLONE
for threads made later), ends the group stop with SIGCONT, lets every thread run but the ones
BPF lists in `held` as stopped at a call, and keeps those in their ptrace-stop until the
enforcer releases them (PTRACE_CONT, signal 0: the SIGSTOP is suppressed). A ptrace-stop is not
undone by SIGCONT, so a sibling cannot release the thread early either. Once none of its
threads has been held for LINGER seconds the process is detached.

Facts this rests on (the H100 host, driver 580, kernel 6.18, 2026-11-25; and this machine):
- ptrace is per tracer *thread*: every request, and the waitpid() that reaps a tracee's
  stops and exits, must come from the thread that seized it. So one thread of ours (`_run`)
  makes every ptrace call; the loop posts commands to it.
- A seized thread that exits must be reaped by the tracer (waitpid(tid, __WALL)), and a
  process must be detached properly, or it never finishes exiting (a quick test hung so).
  We poll waitpid(tid, WNOHANG|__WALL) for every traced thread, never waitpid(-1) (it would
  reap the enforcer's own children: the watchdog, self-test children). A process of our own
  that ended is left to its parent's wait, which reaps it as well (_wait).
- No Yama LSM on the H100 (no /proc/sys/kernel/yama/ptrace_scope) and PTRACE_SEIZE as root
  of every thread of a CUDA process succeeded there.
Where ptrace is refused (another tracer: a debugger; Yama scope 3; EPERM) the process keeps
today's whole-process stop, resumed by SIGCONT: `mode(pid)` says "process", and `refused`
(shown by `convgpu status`) why.

If the enforcer dies, the kernel detaches its tracees and wakes the held threads; they meet
the recheck probe, which stops them again (as a group) while the heartbeat is fresh, and the
watchdog, which turns admission off, SIGCONTs every thread BPF lists in `held` (fail open, as
for any stall)."""
from __future__ import annotations

import ctypes
import errno
import logging
import os
import queue
import signal
import threading
import time
from dataclasses import dataclass, field

from ...threads import Thread

log = logging.getLogger(__name__)

PTRACE_CONT, PTRACE_DETACH = 7, 17
PTRACE_GETEVENTMSG, PTRACE_SEIZE, PTRACE_INTERRUPT, PTRACE_LISTEN = 0x4201, 0x4206, 0x4207, 0x4208
PTRACE_O_TRACECLONE = 0x8
PTRACE_EVENT_CLONE, PTRACE_EVENT_STOP = 3, 128
WALL = 0x40000000            # __WALL: clone children (threads) too
ENDED = (os.CLD_EXITED, os.CLD_KILLED, os.CLD_DUMPED)
STOPSIGS = (signal.SIGSTOP, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU)
POLL = 0.0005                # s between waitpid rounds while anything is traced
LINGER = 0.5                 # s a process stays seized after its last hold (seizing again costs)
YAMA = "/proc/sys/kernel/yama/ptrace_scope"

_libc = ctypes.CDLL(None, use_errno=True)
_libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
_libc.ptrace.restype = ctypes.c_long


def ptrace(req: int, tid: int, addr: int = 0, data: int = 0) -> int:
    """0 or the errno of a failed request."""
    if _libc.ptrace(req, tid, ctypes.c_void_p(addr), ctypes.c_void_p(data)) == -1:
        return ctypes.get_errno()
    return 0


def _event_msg(tid: int) -> int:
    v = ctypes.c_ulong(0)
    _libc.ptrace(PTRACE_GETEVENTMSG, tid, None, ctypes.byref(v))
    return v.value


def _tids(pid: int) -> set[int]:
    try:
        return {int(t) for t in os.listdir(f"/proc/{pid}/task")}
    except OSError:
        return set()


def refused(pid: int) -> str | None:
    """Why ptrace cannot hold pid's threads, before trying: None if it may."""
    try:
        with open(YAMA, encoding="ascii") as f:
            if f.read().strip() == "3":
                return "Yama ptrace_scope is 3 (no ptrace at all)"
    except OSError:
        pass    # no Yama (the H100 host): root may trace
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("TracerPid:") and line.split()[1] != "0":
                    return f"traced by pid {line.split()[1]} (a debugger, or a tracer of its own)"
    except OSError:
        return "gone"
    return None


@dataclass
class _Proc:
    tids: set[int] = field(default_factory=set)
    held: dict[int, int] = field(default_factory=dict)     # tid -> BPF stall number it is held at
    released: dict[int, int] = field(default_factory=dict)  # tid -> the stop last let go (its later
                                                            # traps before the recheck are no new stop)
    jobstop: bool = False        # a job-control stop (not ours) was delivered: threads LISTEN
    idle_since: float = 0.0      # no thread held since (0: one is)
    detaching: bool = False


class ThreadHolder:
    """Holds single threads by ptrace; one thread of ours owns every ptrace call.
    held_seq(pid, tid): the stall number BPF's `held` map lists the thread with (an admission
    stop), or None."""
    name = "ptrace"

    def __init__(self, held_seq):
        self.held_seq = held_seq
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._procs: dict[int, _Proc] = {}      # owned by the ptrace thread
        self.refused: dict[int, str] = {}       # pid -> why it is held whole (read by status)
        self.seized = 0                         # processes seized, over the run
        self.traced: set[int] = set()           # pids seized now (a copy for other threads)
        self._sent: dict[int, dict[int, int]] = {}  # pid -> tid -> the stop let go by SIGCONT (not traced then)
        self._thread: threading.Thread | None = None

    # ---- the loop's side: posts, never a ptrace call ----
    def start(self) -> "ThreadHolder":
        self._thread = Thread(target=self._run, name="convgpu-ptrace", daemon=True)
        self._thread.start()
        return self

    def hold(self, pid: int, tid: int):
        """BPF stopped thread tid of pid at a call: from now on only that thread waits."""
        self._q.put(("hold", pid, tid, 0))

    def release(self, pid: int, tid: int, seq: int = 0):
        """Its call may run (the stop numbered seq; 0: whichever)."""
        self._q.put(("release", pid, tid, seq))

    def forget(self, pid: int):
        self._q.put(("forget", pid, 0, 0))
        self.refused.pop(pid, None)

    def mode(self, pid: int) -> str:
        """"thread" where a stop holds the asking thread alone; "process" where ptrace was
        refused (then a stop holds every thread, and SIGCONT resumes them)."""
        return "process" if pid in self.refused else "thread"

    def close(self, timeout: float = 2.0):
        """Every held thread runs again and every process is detached."""
        if self._thread is None:
            return
        self._q.put(("close", 0, 0, 0))
        self._thread.join(timeout)
        self._thread = None

    # ---- the ptrace thread ----
    def _run(self):
        closing = False
        while True:
            try:
                cmd = self._q.get(timeout=POLL if self._procs else 0.5)
                while True:
                    closing = self._command(*cmd) or closing
                    cmd = self._q.get_nowait()
            except queue.Empty:
                pass
            except Exception:   # never let the thread die with threads held
                log.exception("ptrace holder")
            self._reap()
            self._linger(closing)
            if closing and not self._procs:
                return

    def _command(self, what: str, pid: int, tid: int, seq: int) -> bool:
        if what == "hold":
            if pid not in self.refused:
                self._seize(pid)
        elif what == "release":
            self._release(pid, tid, seq)
        elif what == "forget":
            p = self._procs.get(pid)
            if p is not None:
                p.held.clear()
            self._sent.pop(pid, None)
        elif what == "close":
            for pid, p in self._procs.items():
                for t in list(p.held):
                    self._cont(p, t, 0)
                p.held.clear()
                p.idle_since = 1.0   # long idle: detached at once
            return True
        return False

    def _seize(self, pid: int):
        """pid's threads, all traced (those not yet: a process seized before that was being
        detached keeps its tracees, and they stay unless detached already)."""
        p = self._procs.get(pid)
        if p is not None:
            p.detaching = False   # its INTERRUPT traps now only resume (_on_stop)
            new = [t for t in sorted(_tids(pid) - p.tids) if ptrace(PTRACE_SEIZE, t, 0, PTRACE_O_TRACECLONE) == 0]
            p.tids.update(new)
            if any(_state(pid, t) in "tT" for t in new):   # a group stop of a thread let go before
                _kill(pid, signal.SIGCONT)
            return
        tids = _tids(pid)
        if len(tids) <= 1:    # one thread: holding it is holding the process (no ptrace needed)
            return
        why = refused(pid)
        if why is None:
            # idle from the start: nothing is held until a thread's stop is kept (_keep). Its
            # stop may be released before the holder sees the thread stop (a placement granted
            # within a millisecond), and then no thread ever is; idle_since 0 ("one is held")
            # kept such a process seized for good, polled every POLL (issue 32: the enforcer's
            # thousands of wake-ups a second under a workload that only allocated)
            p = _Proc(idle_since=time.monotonic())
            for _ in range(16):   # threads made meanwhile by a thread not yet seized
                new = _tids(pid) - p.tids
                if not new:
                    break
                for t in sorted(new):
                    err = ptrace(PTRACE_SEIZE, t, 0, PTRACE_O_TRACECLONE)
                    if err == errno.ESRCH:
                        continue
                    if err:
                        why = f"PTRACE_SEIZE: {os.strerror(err)}"
                        break
                    p.tids.add(t)
                if why:
                    break
            if why is None:
                p.released.update(self._sent.pop(pid, {}))
                self._procs[pid] = p
                self.traced.add(pid)
                self.seized += 1
                # seized threads that were in the group stop are in a ptrace-stop now: end the
                # group stop, so that a thread let go is not stopped again at its detach
                if any(_state(pid, t) in "tT" for t in p.tids):
                    _kill(pid, signal.SIGCONT)
                return
            self._undo(p)
        self.refused[pid] = why
        log.warning("pid %d: %s: its waits stop the whole process (SIGCONT resumes it)%s", pid, why,
                    "; a thread its tracer lets run on without a grant is killed at its recheck (BPF)"
                    if why.startswith("traced") else "")

    def _undo(self, p: _Proc):
        """Detach what a failed seize took: stop each (INTERRUPT), then DETACH it, passing on a
        signal it stopped with (our SIGSTOP then stops the whole process, as without ptrace)."""
        for t in p.tids:
            ptrace(PTRACE_INTERRUPT, t)
        deadline = time.monotonic() + 1.0
        left = set(p.tids)
        while left and time.monotonic() < deadline:
            for t in list(left):
                st = _wait(t)
                if st is None:
                    continue
                if os.WIFSTOPPED(st):
                    sig = os.WSTOPSIG(st) if st >> 16 == 0 else 0
                    ptrace(PTRACE_DETACH, t, 0, sig)
                left.discard(t)
            time.sleep(POLL)

    def _release(self, pid: int, tid: int, seq: int):
        log.debug("release pid %d thread %d stop %d", pid, tid, seq)
        p = self._procs.get(pid)
        if p is None or tid not in p.tids:   # held whole (refused, one thread, or detached
            # already): the stop is a group stop. Remembered as let go all the same: BPF lists
            # a stop ended after its recheck stopped it again (a restall) in `held` until the
            # thread's call returns (the recheck probe does not fire twice), and a seize at a
            # sibling's stop meanwhile must not take that stale entry for a stop to keep (it
            # held the thread for good: nobody waits to release it; issue 23)
            seq = seq or self.held_seq(pid, tid) or 0
            (p.released if p is not None else self._sent.setdefault(pid, {}))[tid] = seq
            _kill(pid, signal.SIGCONT)
            return
        if not seq:
            seq = p.held.get(tid) or self.held_seq(pid, tid) or 0
        p.released[tid] = seq     # its stop, held or on its way: released when it comes
        if p.held.get(tid) == seq:
            del p.held[tid]
            self._cont(p, tid, 0)

    def _cont(self, p: _Proc, tid: int, sig: int):
        ptrace(PTRACE_CONT, tid, 0, sig)
        if not p.held:
            p.idle_since = p.idle_since or time.monotonic()

    def _keep(self, pid: int, p: _Proc, tid: int) -> bool:
        """At a stop of tid: is it BPF's stop at a call, not yet released? Then held (and a
        detach under way stops: the threads it let go already are seized again at the hold)."""
        seq = self.held_seq(pid, tid)
        if seq is None:
            return False
        if p.released.get(tid) == seq:
            return False
        p.held[tid] = seq
        p.idle_since = 0.0
        p.detaching = False
        return True

    def _reap(self):
        for pid, p in list(self._procs.items()):
            for tid in list(p.tids):
                st = _wait(tid)
                if st is not None:
                    self._on_stop(pid, p, tid, st)
            if not p.tids:
                del self._procs[pid]
                self.traced.discard(pid)

    def _on_stop(self, pid: int, p: _Proc, tid: int, st: int):
        log.debug("pid %d thread %d: status %#x held %s", pid, tid, st, p.held)
        if st == -1 or os.WIFEXITED(st) or os.WIFSIGNALED(st):
            p.tids.discard(tid)
            p.held.pop(tid, None)
            p.released.pop(tid, None)
            return
        if not os.WIFSTOPPED(st):
            return
        sig, event = os.WSTOPSIG(st), st >> 16
        if event == PTRACE_EVENT_CLONE:          # a new thread: traced already (TRACECLONE)
            p.tids.add(_event_msg(tid))
            ptrace(PTRACE_CONT, tid, 0, 0)
            return
        if event == PTRACE_EVENT_STOP:           # group-stop, INTERRUPT, new thread, LISTEN woken
            if self._keep(pid, p, tid):
                return
            if p.detaching:
                ptrace(PTRACE_DETACH, tid, 0, 0)
                p.tids.discard(tid)
            elif sig in STOPSIGS and p.jobstop:  # someone's job-control stop: keep it, as SIGCONT ends it
                ptrace(PTRACE_LISTEN, tid)
            else:
                ptrace(PTRACE_CONT, tid, 0, 0)
            return
        # signal-delivery-stop
        if sig == signal.SIGSTOP:
            if self._keep(pid, p, tid):
                return
            if self.held_seq(pid, tid) is not None:
                sig = 0                          # ours, released already: suppressed
        if sig in STOPSIGS:
            p.jobstop = True
        elif sig == signal.SIGCONT:
            p.jobstop = False
        if p.detaching:
            ptrace(PTRACE_DETACH, tid, 0, sig)
            p.tids.discard(tid)
        else:
            ptrace(PTRACE_CONT, tid, 0, sig)

    def _linger(self, closing: bool):
        now = time.monotonic()
        for pid, p in self._procs.items():
            if p.detaching or p.held or not p.idle_since:
                continue
            if any(self.held_seq(pid, t) is not None for t in p.tids):
                continue   # a stop released but not yet past its recheck, or one on its way
            if closing or now - p.idle_since >= LINGER:
                p.detaching = True
                for t in p.tids:
                    ptrace(PTRACE_INTERRUPT, t)   # DETACH needs a ptrace-stop: at its trap


def _wait(tid: int) -> int | None:
    """tid's next status (a stop or its exit), None if nothing new; -1 if it is no tracee, or
    it is a child of this very process that ended: its parent thread reaps it. A tracer in its
    parent's thread group that reaps it leaves the parent's wait ECHILD, which subprocess reads
    as exit status 0 (a kill taken for success): the enforcer's own children, and the test
    suite's, whose enforcers run in the test's process."""
    try:
        peek = os.waitid(os.P_PID, tid, os.WEXITED | os.WNOHANG | os.WNOWAIT | WALL)   # leaves it
        if peek is None:
            return None
        if peek.si_code in ENDED and _own_child(tid):
            return -1
        got, st = os.waitpid(tid, os.WNOHANG | WALL)
    except ChildProcessError:
        return -1
    return st if got else None


def _own_child(tid: int) -> bool:
    """tid leads a process this one started."""
    try:
        with open(f"/proc/{tid}/status", encoding="ascii", errors="replace") as f:
            ids = dict(line.split(":", 1) for line in f if line.startswith(("Tgid:", "PPid:")))
        return int(ids["Tgid"]) == tid and int(ids["PPid"]) == os.getpid()
    except (OSError, KeyError, ValueError):
        return False


def _state(pid: int, tid: int) -> str:
    try:
        with open(f"/proc/{pid}/task/{tid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"


def _kill(pid: int, sig: int):
    try:
        os.kill(pid, sig)
    except OSError:
        pass
