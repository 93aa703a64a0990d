"""Fail-safe: no process stays stopped because the enforcer is gone; and accounting goes on
until another enforcer takes over.

The enforcer starts this as a separate session (a kill of the enforcer's process group does
not reach it) and keeps a state file of what it holds stopped: pids it must SIGCONT and
cgroups it froze. When the enforcer dies, even by SIGKILL, this process resumes everything in
the file at once. It learns of the death from a pipe whose write end only the enforcer holds:
the kernel closes it early in the exit, before the ~100 ms per uprobe that releasing the probes
costs (a pidfd fires only after all of that, seconds later with 60 probes).
It also holds the BPF `control` map and first turns admission off, so nothing is stopped again.
And it holds duplicates of the enforcer's probe descriptors (sent over FD_SOCK as they are
attached): after the death the probes stay attached and keep the pinned maps exact, until a
restarted enforcer, loaded over the same maps, sends SIGTERM; then this exits and the old
probes detach. Without a successor within CONVGPU_HANDOVER_S (600 s) it removes the pins too.
With --handover (the enforcer's state file says how long: `handover`), a death hands over:
what the enforcer held stays held and admission stays on (this keeps the heartbeat fresh) for
up to that long, so a systemd restart or a DaemonSet rollout lets no stalled process past its
limit; the successor takes the held calls over (enforcer/failsafe/adopt.py `stalled`) and sends
SIGTERM, and only a stop at a driver's open (the predecessor's discovery) is resumed here then.
With no successor in time, everything is resumed as at any death.
`convgpu trace` runs one too, for discovery alone: a process stopped at its open of a driver
file (bpf/discovery.bpf.c) is listed in the `held` map, which this resumes; so is
every thread BPF stopped for admission, whether or not the enforcer wrote it in its state file.
    python -m convgpu.enforcer.failsafe.watchdog ENFORCER_PID STATE_FILE PIPE_FD ZERO_MAP_FDS HELD_MAP_FD [FD_SOCK PIN_DIR]
ZERO_MAP_FDS: comma-separated array maps whose entry 0 is zeroed (control: admission off;
discovery: no more stops); HELD_MAP_FD: the `held` map, or -1; STATE_FILE may be "-"."""
import ctypes
import fcntl
import json
import os
import resource
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

HANDOVER_S = float(os.environ.get("CONVGPU_HANDOVER_S", "600"))
HELD_OPEN = 1 << 32   # a `held` value's bit for a stop at a driver's open (probes/held.py: stdlib only here)
BEAT_S = 0.25         # s between heartbeats kept while handing over (BPF fails open after 2 s)


def write_state(path: str, pids, cgroups, **more) -> None:
    """Atomically replace the state file (the watchdog may read it at any moment)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"pids": sorted(pids), "cgroups": sorted(cgroups), **more}, f)
    os.replace(tmp, path)


class _Attr(ctypes.Structure):   # union bpf_attr, as the map element commands use it
    _fields_ = [("map_fd", ctypes.c_uint32), ("pad", ctypes.c_uint32), ("key", ctypes.c_uint64),
                ("value", ctypes.c_uint64), ("flags", ctypes.c_uint64)]


def _bpf(cmd: int, map_fd: int, key, value=None) -> bool:
    """One map element command; key None: NULL (GET_NEXT_KEY: the first key)."""
    attr = _Attr(map_fd, 0, ctypes.addressof(key) if key is not None else 0,
                 ctypes.addressof(value) if value is not None else 0, 0)
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(321, cmd, ctypes.byref(attr), ctypes.sizeof(attr)) == 0   # SYS_bpf


def admission_off(map_fd: int) -> bool:
    """BPF_MAP_UPDATE_ELEM of entry 0 = all zero (struct cg_control: enforcing = 0;
    struct cg_discovery: on = 0)."""
    return _bpf(2, map_fd, ctypes.c_uint32(0), (ctypes.c_ubyte * 64)())   # >= either struct


def heartbeat(map_fd: int) -> bool:
    """The control map's heartbeat (struct cg_control's first field, bpf_ktime_get_ns's clock)
    made fresh, the other fields as they are: admission goes on while a successor comes."""
    leaf = (ctypes.c_ubyte * 64)()
    if not _bpf(1, map_fd, ctypes.c_uint32(0), leaf):   # BPF_MAP_LOOKUP_ELEM
        return False
    ctypes.c_uint64.from_buffer(leaf).value = time.monotonic_ns()
    return _bpf(2, map_fd, ctypes.c_uint32(0), leaf)


def resume_held(map_fd: int, opens_only: bool = False) -> set[int]:
    """SIGCONT every process with a thread in the `held` map (pid_tgid -> why: BPF stopped it,
    at a driver's open or for admission) and empty the map; opens_only: only stops at an open
    (a successor takes the calls over). Returns the pids signalled."""
    keys, key, nxt = [], None, ctypes.c_uint64(0)
    while _bpf(4, map_fd, key, nxt):   # BPF_MAP_GET_NEXT_KEY
        keys.append(nxt.value)
        key = ctypes.c_uint64(nxt.value)
    if opens_only:
        why = ctypes.c_uint64(0)
        keys = [k for k in keys if _bpf(1, map_fd, ctypes.c_uint64(k), why) and why.value & HELD_OPEN]
    done = set()
    for pid in {k >> 32 for k in keys}:
        try:
            os.kill(pid, signal.SIGCONT)
            done.add(pid)
        except OSError:
            pass
    for k in keys:
        _bpf(3, map_fd, ctypes.c_uint64(k))   # BPF_MAP_DELETE_ELEM
    return done


def spawn(owner_pid: int, state_file: str, zero_fds: list[int], held_fd: int = -1,
          fd_sock: socket.socket | None = None, pin_dir: str | None = None):
    """Start the watchdog of `owner_pid` (this process): returns (Popen, lifeline fd). Keep the
    lifeline open for as long as we live; its close at our death wakes the watchdog. At exit the
    kernel closes descriptors in ascending order and runs the releases in reverse, so the
    highest descriptor is released first, ahead of the perf events whose uprobe detach costs
    ~100 ms each. Its own session: a kill of our process group must not take it with us."""
    r, w = os.pipe()
    top = resource.getrlimit(resource.RLIMIT_NOFILE)[0] - 1
    lifeline = fcntl.fcntl(w, fcntl.F_DUPFD_CLOEXEC, max(top - 16, w))
    os.close(w)
    args = [str(owner_pid), state_file, str(r), ",".join(map(str, zero_fds)), str(held_fd)]
    fds = [r, *zero_fds] + ([held_fd] if held_fd >= 0 else [])
    if fd_sock is not None:
        args += [str(fd_sock.fileno()), pin_dir or ""]
        fds.append(fd_sock.fileno())
    p = subprocess.Popen([sys.executable, __file__, *args], start_new_session=True, pass_fds=fds)   # stdlib only
    os.close(r)
    return p, lifeline


def read_state(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def hand_over(path: str, control_fd: int, seconds: float, taken_over: list) -> bool:
    """Keep what the dead enforcer held, and admission on, until a successor takes over
    (SIGTERM: taken_over fills) or `seconds` pass. True if one came."""
    state = read_state(path)
    state.update(orphaned=True, handing_over=True, watchdog=os.getpid())
    try:
        write_state(path, **state)   # previous() takes it for a take-over at once
    except OSError:   # its run dir is gone: nobody can take over
        return False
    deadline = time.monotonic() + seconds
    while not taken_over and time.monotonic() < deadline:
        heartbeat(control_fd)
        time.sleep(BEAT_S)
    return bool(taken_over)


def thaw(dirs) -> int:
    """Thaw each cgroup (full directory paths, v2 or v1); returns how many were written."""
    thawed = 0
    for d in dirs:
        for name, value in (("cgroup.freeze", "0"), ("freezer.state", "THAWED")):
            try:
                with open(os.path.join(d, name), "w") as f:
                    f.write(value)
                thawed += 1
            except OSError:
                pass
    return thawed


def release(path: str) -> tuple[set[int], int]:
    """Resume what the state file lists; returns (pids signalled, cgroups thawed)."""
    state = read_state(path) if path != "-" else {}
    if not state:
        return set(), 0
    done = set()
    for pid in state.get("pids", []):
        try:
            os.kill(pid, signal.SIGCONT)
            done.add(pid)
        except OSError:
            pass
    thawed = thaw(state.get("cgroups", []))
    state.update(pids=[], cgroups=[], orphaned=True, watchdog=os.getpid())
    write_state(path, **{k: v for k, v in state.items()})   # for the successor: who to stop
    return done, thawed


def swap_release(state: dict) -> int | None:
    """Where the dead enforcer left processes swapped out or locked (its swap.json): a release
    agent of its own session (enforcer/swap/agent.py --release) unlocks them and restores each
    once it fits, so none stays locked with nobody to unlock it. Its pid, or None."""
    argv = state.get("release")
    try:
        with open(argv[-1]) as f:
            if not json.load(f).get("procs"):
                return None
    except (OSError, ValueError, TypeError, IndexError, AttributeError):
        return None
    return subprocess.Popen(argv, start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            cwd="/").pid


def link_id(fd: int) -> int | None:
    """The BPF link behind a descriptor (fdinfo's link_id), None for anything else."""
    try:
        with open(f"/proc/self/fdinfo/{fd}") as f:
            return next((int(x.split()[1]) for x in f if x.startswith("link_id:")), None)
    except (OSError, ValueError):
        return None


def wait_for_death(pipe_fd: int, fd_sock: socket.socket | None, held: list[int]) -> None:
    """Until the pipe's EOF; meanwhile keep every probe descriptor the enforcer sends, and close
    ours of the links it released (a driver copy no process uses any more: b"d" + link ids)."""
    while True:
        ready, _, _ = select.select([pipe_fd] + ([fd_sock] if fd_sock else []), [], [])
        if fd_sock in ready:
            try:
                msg, fds, _, _ = socket.recv_fds(fd_sock, 65536, 253)
            except OSError:
                msg, fds = b"", []
            if msg.startswith(b"d"):
                gone = {int(x) for x in msg[1:].split()}
                drop = [fd for fd in held if link_id(fd) in gone]
                held[:] = [fd for fd in held if fd not in drop]
                close_all(drop)
            held.extend(fds)
        if pipe_fd in ready and not os.read(pipe_fd, 64):
            return


def oom_kills() -> tuple[str, int] | None:
    """(this process's memory cgroup, the OOM kills it counts), v1 (memory.oom_control) or v2
    (memory.events); None where neither can be read. The watchdog shares the enforcer's cgroup
    (a systemd service, a pod): a count that grew while the enforcer ran names its death."""
    try:
        lines = open("/proc/self/cgroup").read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, ctrls, cg = line.split(":", 2)
        if "memory" in ctrls.split(","):
            where = [("/sys/fs/cgroup/memory" + cg, "memory.oom_control")]
        elif ctrls == "":
            where = [(root + cg, "memory.events") for root in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified")]
        else:
            continue
        for d, name in where:
            try:
                for row in open(os.path.join(d, name)).read().splitlines():
                    if row.startswith("oom_kill "):
                        return cg, int(row.split()[1])
            except (OSError, ValueError):
                continue
    return None


def oom_note(before: tuple[str, int] | None) -> str:
    """What the log line adds when the memory cgroup counted an OOM kill meanwhile."""
    now = oom_kills()
    if now is None or now[1] <= (before[1] if before and before[0] == now[0] else 0):
        return ""
    return (f"; its memory cgroup {now[0]} counts {now[1]} OOM kill(s): the enforcer likely ran out of "
            "memory (raise that cgroup's memory limit)")


def main() -> int:
    pid, path, pipe_fd = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    zero_fds = [int(x) for x in sys.argv[4].split(",") if x]
    held_fd = int(sys.argv[5])
    fd_sock = socket.socket(fileno=int(sys.argv[6])) if len(sys.argv) > 6 else None
    pin_dir = sys.argv[7] if len(sys.argv) > 7 and sys.argv[7] else None
    signal.signal(signal.SIGTERM, signal.SIG_IGN)   # only the enforcer's death ends it
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    held: list[int] = []
    ooms = oom_kills()
    wait_for_death(pipe_fd, fd_sock, held)
    taken_over: list = []
    signal.signal(signal.SIGTERM, lambda *_: taken_over.append(1))
    state = read_state(path) if path != "-" else {}
    handover = float(state.get("handover") or 0)
    if handover > 0 and zero_fds and held:
        # first: every process with a held call stopped whole. A thread the enforcer held alone by
        # ptrace is let go by the kernel when its tracer is gone (its exit runs after the close of
        # the lifeline and of its probes' links, which woke us), and one held at its recheck would
        # run its call unchecked; a process in a group stop stays stopped (FACTS.md, issue 47)
        for held_pid in state.get("pids", []):   # (not `pid`: the enforcer's, said below)
            try:
                os.kill(held_pid, signal.SIGSTOP)
            except OSError:
                pass
    if handover > 0 and zero_fds and held and hand_over(path, zero_fds[0], handover, taken_over):
        opened = resume_held(held_fd, opens_only=True) if held_fd >= 0 else set()
        print(f"convgpu watchdog: enforcer {pid} is gone; its successor took over what it held"
              + (f", {len(opened)} stopped at an open resumed" if opened else ""), file=sys.stderr)
        close_all(held)   # the old probes detach
        return 0
    for fd in zero_fds:   # first: nothing is stopped again
        admission_off(fd)
    before = read_state(path) if path != "-" else {}
    stopped = resume_held(held_fd) if held_fd >= 0 else set()
    listed, thawed = release(path)
    swap_release(before)
    if held_fd >= 0:   # a program past its check when the maps were zeroed may still stop one
        time.sleep(0.05)   # (its vCPU taken away mid-program by the host): looked at again
        stopped |= resume_held(held_fd)
    print(f"convgpu watchdog: enforcer {pid} is gone; resumed {len(stopped | listed)} processes, thawed {thawed} cgroups"
          + (f"; {len(held)} probes kept for a successor" if held else "") + oom_note(ooms), file=sys.stderr)
    if not held:
        return 0
    deadline = time.monotonic() + HANDOVER_S
    while not taken_over and time.monotonic() < deadline:
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
    if not taken_over:   # nobody came: nothing may keep stale state
        if pin_dir:
            shutil.rmtree(pin_dir, ignore_errors=True)
        try:
            os.unlink(path)
        except OSError:
            pass
    close_all(held)   # the old probes detach
    return 0


def close_all(fds: list[int]) -> None:
    """One thread per descriptor: the releases of BPF links wait for their grace periods
    together, not one after another as at exit (probes/links.py)."""
    threads = [threading.Thread(target=os.close, args=(fd,)) for fd in fds]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


if __name__ == "__main__":
    sys.exit(main())
