"""One enforcer per host, whatever its run dir (issue 52).

Uprobes are set on a driver file's inode, so two enforcers on one host each see, place and
stall the other's processes: the first stopped the second's self-test child (`needs 180970.3
TiB`, a request it never made), and each keeps books of one card that the other spends. The
control socket catches a second enforcer on the same run dir only. So `convgpu enforce` takes
an exclusive flock(2) on one file at a fixed path before it probes anything, and keeps it for
its life (the kernel drops it at any exit, kill -9 included); the file says who holds it, so a
second one refuses naming the first's pid and run dir.

The default path is in /run/convgpu, the run dir the systemd unit and the DaemonSet share with
the host (deploy/kubernetes mounts it), so a DaemonSet's enforcer and a host's see each other.
CONVGPU_HOST_LOCK moves it: for the test suite only, whose workers each run enforcers on a copy
of the stand-in driver of their own (tests/conftest.py), beside other worktrees' suites."""
import fcntl
import json
import os
import time

from ..errors import ConfigError

DEFAULT = "/run/convgpu/enforcer.lock"
ENV = "CONVGPU_HOST_LOCK"   # test-only: one lock per test worker (tests/conftest.py)
WAIT = 3.0                  # s a start waits: a predecessor still exiting (systemctl restart)


def path() -> str:
    return os.environ.get(ENV) or DEFAULT


def holder(fd: int) -> dict:
    """What the lock's holder wrote: {"pid": ..., "run_dir": ...}, or {} (not written yet)."""
    try:
        raw = os.pread(fd, 4096, 0)
        got = json.loads(raw) if raw else {}
        return got if isinstance(got, dict) else {}
    except (OSError, ValueError):
        return {}


def take(run_dir: str, wait: float = WAIT) -> int:
    """Lock the host for this enforcer; returns the descriptor to keep open for its life.
    Refuses (ConfigError) while another enforcer holds it."""
    p = path()
    os.makedirs(os.path.dirname(p), mode=0o755, exist_ok=True)
    fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                other = holder(fd)
                os.close(fd)
                who = (f"pid {other.get('pid', '?')}, run dir {other.get('run_dir', '?')}" if other
                       else "its pid not written yet")
                raise ConfigError(f"another enforcer runs on this host ({who}; it holds {p})",
                                  "stop it first (`systemctl stop convgpu-enforce`, or its pid): one enforcer "
                                  "per host, as two would see and stall each other's processes") from None
            time.sleep(0.05)
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"pid": os.getpid(), "run_dir": os.path.abspath(run_dir)}).encode() + b"\n", 0)
    return fd


def running() -> dict:
    """The enforcer that holds the host's lock ({"pid", "run_dir"}), or {} where none does (or
    the lock cannot be read: not root). For clients: where to find it."""
    try:
        fd = os.open(path(), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return {}
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return {}          # nobody holds it
    except BlockingIOError:
        return holder(fd) or {"pid": "?", "run_dir": "?"}
    except OSError:
        return {}
    finally:
        os.close(fd)
