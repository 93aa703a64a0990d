"""Who a socket peer is, and how much of the daemon it may take (issue 24, rows 5, 6 and 9).

Every process on the host can reach the shim socket, so each of these is hostile: how many
connections it opens, how fast it sends, whether it reads its replies, how many lines it makes
us log, and whether the process that connected is still the one behind its pid.

- Identity: the kernel's. SO_PEERPIDFD (Linux 6.5) hands a pidfd of the process that called
  connect(), taken by the kernel at that moment; older kernels get pidfd_open(SO_PEERCRED's pid)
  at accept, checked alive. A pidfd polls readable once its process has exited, so a peer whose
  process is gone is known as gone even after its pid was reused (row 9).
- Caps (row 5): connections per process, per group (its container) and in all; a reserve fd
  so that EMFILE never stops the accept loop (the daemon accepts and closes instead).
- Budgets (row 6): requests per group and second (a token bucket: over it, the group's peers
  are not read until it refills, so nothing is lost and the sender waits in its own send), and
  log lines per group and minute (the rest are counted and said in one line)."""
import errno
import logging
import os
import select
import socket
import struct
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)
SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)   # include/uapi/asm-generic/socket.h
# accept() errors that say "no room now", not "this connection is bad": the listening socket
# stays readable, so without the reserve fd the loop would spin on them (or, before, die)
NO_ROOM = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


@dataclass(frozen=True)
class Caps:
    """What one peer may make the daemon hold. A shim opens one connection per thread that
    calls CUDA (dozens in a PyTorch process); its replies are one short line each, read at once;
    its messages are under 200 bytes; a busy process sends a few thousand a second."""
    per_process: int = 64          # connections
    per_group: int = 512           # connections of one container's processes together
    total: int = 4096              # connections in all (each one an fd; see raise_nofile)
    out_bytes: int = 256 << 10     # replies a peer has not read: past this it is dropped
    line: int = 64 << 10           # longest request
    rate: float = 50_000.0         # requests per group and second (burst: one second's worth)
    log_lines: int = 20            # log lines per group and minute


SHIM_CAPS = Caps(line=4 << 10)
# root's own (the CLI, the Kubernetes agents): a DRA Prepare sends its claims in one request
# (thousands of them: kube/dra.py MAX_CLAIMS), so its line may be long
CONTROL_CAPS = Caps(per_process=16, per_group=64, total=256, out_bytes=64 << 20, line=32 << 20, rate=1e9)


@dataclass(frozen=True)
class Identity:
    pid: int
    uid: int
    gid: int
    pidfd: int      # -1: the kernel gave none (then only the pid, checked at accept)

    def exited(self) -> bool:
        return exited(self.pidfd)


def exited(pidfd: int) -> bool:
    if pidfd < 0:
        return False
    p = select.poll()
    p.register(pidfd, select.POLLIN)
    return bool(p.poll(0))


def identify(conn: socket.socket) -> Identity | None:
    """The peer's process as the kernel knows it; None if it has already exited. OSError:
    no fd for its pidfd (NO_ROOM)."""
    pid, uid, gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                        struct.calcsize("3i")))
    try:
        pidfd = struct.unpack("i", conn.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD, 4))[0]
    except OSError as e:
        if e.errno in NO_ROOM:
            raise
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            return None
    if exited(pidfd):
        os.close(pidfd)
        return None
    return Identity(pid, uid, gid, pidfd)


def raise_nofile() -> int:
    """Soft RLIMIT_NOFILE up to the hard one (systemd's default soft limit is 1024: 1,000
    connections would end the daemon's accepts); returns the soft limit now in force."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


class Reserve:
    """One fd kept open for the moment the daemon has none: on EMFILE it is closed, the
    waiting connection accepted and closed at once (the peer sees EOF, not a hang), and it is
    taken again."""

    def __init__(self):
        self.fd = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)

    def shed(self, sock: socket.socket) -> bool:
        """Accepts and closes one waiting connection; False if even that failed."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            conn, _ = sock.accept()
            conn.close()
            return True
        except OSError:
            return False
        finally:
            try:
                self.fd = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                self.fd = -1

    def close(self):
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class Buckets:
    """A token bucket per group: `take(group)` is False once the group used its second's
    worth; `ready(group)` says when it may go on."""

    def __init__(self, rate: float, clock=time.monotonic):
        self.rate, self.clock = rate, clock
        self.tokens: dict[str, tuple[float, float]] = {}   # group -> (tokens, at)

    def _now(self, group: str) -> float:
        t = self.clock()
        tokens, at = self.tokens.get(group, (self.rate, t))
        tokens = min(self.rate, tokens + (t - at) * self.rate)
        self.tokens[group] = (tokens, t)
        return tokens

    def take(self, group: str) -> bool:
        tokens = self._now(group)
        if tokens < 1:
            return False
        self.tokens[group] = (tokens - 1, self.tokens[group][1])
        return True

    def ready(self, group: str) -> bool:
        return self._now(group) >= 1

    def forget(self, group: str):
        self.tokens.pop(group, None)


class LogBudget:
    """At most `lines` log lines per group and minute; the rest are counted and said in one
    line when the group's next minute starts (a container that sends garbage cannot fill the
    host's journal, and the operator still learns how much it sent)."""

    def __init__(self, lines: int, logger: logging.Logger = log, window: float = 60.0, clock=time.monotonic):
        self.lines, self.logger, self.window, self.clock = lines, logger, window, clock
        self.seen: dict[str, list] = {}   # group -> [window start, lines said, lines held back]

    def __call__(self, group: str, level: int, fmt: str, *args):
        t = self.clock()
        s = self.seen.get(group)
        if s is None or t - s[0] >= self.window:
            if s is not None and s[2]:
                self.logger.warning("%d more log lines about %s were held back in the last minute", s[2], group)
            if len(self.seen) > 4096:   # bounded: groups that went quiet are forgotten
                self.seen = {g: v for g, v in self.seen.items() if t - v[0] < self.window}
            s = self.seen[group] = [t, 0, 0]
        if s[1] < self.lines:
            s[1] += 1
            self.logger.log(level, fmt, *args)
        else:
            s[2] += 1
