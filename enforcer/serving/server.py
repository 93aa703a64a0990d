"""JSON-lines over a UNIX stream socket, for the enforcer's control socket (root: `convgpu
status`, `limit set`, `reload`, `run`) and the shim socket (issue "shim").

One request per line, one JSON object per reply line. The peer is who the kernel says it is
(SO_PEERCRED and a pidfd, enforcer/serving/peers.py), never what a message claims. A handler may
answer later (a shim waiting for memory): it returns DEFER and calls `Server.reply(peer, obj)`
when ready. Malformed or oversized input gets an error reply (oversized: and the connection
closes); a client that goes away mid-request is forgotten (`closed`) and nothing else is
affected. What a peer may make the daemon hold is capped (peers.Caps, issue 24): connections
per process, per container and in all, unread replies, line length, requests per second; an
accept error never ends the loop; a peer whose process has exited is dropped before its next
request acts (its pid may belong to another process by then). The socket and its directory are
checked every tick and re-created if anyone replaced or loosened them (a container given the
directory read-write could otherwise put its own socket there for its neighbours)."""
import errno
import json
import logging
import os
import selectors
import socket
import stat
import time
from dataclasses import dataclass, field

from .peers import CONTROL_CAPS, NO_ROOM, Buckets, Caps, Identity, LogBudget, Reserve, identify

log = logging.getLogger(__name__)
DEFER = object()
MAX_LINE = CONTROL_CAPS.line
PAUSE_ACCEPT = 0.1    # s without accepting when even the reserve fd could not shed a connection


@dataclass(eq=False)
class Peer:
    conn: socket.socket
    pid: int
    uid: int
    gid: int
    ident: Identity | None = None
    group: str = ""                              # its container: caps and budgets are per group
    buf: bytearray = field(default_factory=bytearray)
    out: bytearray = field(default_factory=bytearray)
    state: dict = field(default_factory=dict)   # per connection, for the handler
    fds: list = field(default_factory=list)     # passed (SCM_RIGHTS) with the next reply
    gone: bool = False
    held: bool = False                           # its group is over its request rate: not read


class Handler:
    """What a server serves: `handle` answers a dict (or DEFER); `closed` cleans up."""

    def handle(self, peer: Peer, msg: dict):
        raise NotImplementedError

    def closed(self, peer: Peer) -> None:
        pass


def _by_uid(ident: Identity) -> str:
    return f"uid {ident.uid}"


class Server:
    def __init__(self, path: str, handler: Handler, mode: int = 0o600, root_only: bool = True,
                 sel: selectors.BaseSelector | None = None, caps: Caps = CONTROL_CAPS, group_of=_by_uid):
        self.path, self.handler, self.root_only, self.mode = path, handler, root_only, mode
        self.caps, self.group_of = caps, group_of   # group_of(Identity) -> str; may raise
        handler.server = self   # for replies it defers
        self.sel = sel or selectors.DefaultSelector()
        self.peers: set[Peer] = set()
        self.by_pid: dict[int, int] = {}
        self.by_group: dict[str, int] = {}
        self.held: set[Peer] = set()
        self.buckets = Buckets(caps.rate)
        self.say = LogBudget(caps.log_lines, log)
        self.reserve = Reserve()
        self.refused = 0           # connections closed unserved (caps, no fds)
        self._paused_until = 0.0
        self.sock = None
        os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
        self._bind()

    def _bind(self):
        """A fresh listening socket at self.path (whatever was there is removed: a socket left
        by a dead enforcer, or one someone put in its place)."""
        self._check_dir()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        old = os.umask(0o777 & ~self.mode)   # never world-reachable, not even between bind and chmod
        try:
            sock.bind(self.path)
        finally:
            os.umask(old)
        os.chmod(self.path, self.mode, follow_symlinks=False)
        sock.listen(128)
        st = os.lstat(self.path)
        self.bound = (st.st_dev, st.st_ino)
        if self.sock is not None:
            self._unlisten()
            self.sock.close()
        self.sock = sock
        self.sel.register(self.sock, selectors.EVENT_READ, self._accept)

    def _check_dir(self) -> bool:
        """The socket's directory: a directory, ours, writable by nobody else (else anyone
        could swap the socket); put right if not. True if it was right."""
        d = os.path.dirname(self.path)
        st = os.lstat(d)
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o022:
            return True
        log.warning("%s was %s, owner uid %d, mode %o: made ours and writable by root only again "
                    "(mount it read-only into containers, docs/SHIM.md)", d,
                    "a directory" if stat.S_ISDIR(st.st_mode) else "not a directory", st.st_uid,
                    stat.S_IMODE(st.st_mode))
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(d)
            os.mkdir(d, 0o755)
        else:
            os.chown(d, os.geteuid(), os.getegid(), follow_symlinks=False)
            os.chmod(d, stat.S_IMODE(st.st_mode) & ~0o022, follow_symlinks=False)
        return False

    def _guard(self):
        """The socket at our path is the one we bound, as we made it; else it is made again
        (peers already connected keep their connections)."""
        try:
            fine = self._check_dir()
            st = os.lstat(self.path)
            if fine and (st.st_dev, st.st_ino) == self.bound and st.st_uid == os.geteuid() \
                    and stat.S_IMODE(st.st_mode) == self.mode:
                return
            what = f"changed (owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}, inode {st.st_ino})"
        except FileNotFoundError:
            what = "removed"
        except OSError as e:
            log.error("cannot check %s: %s", self.path, e)
            return
        log.warning("%s was %s: listening on a new socket there (mount its directory read-only "
                    "into containers, docs/SHIM.md)", self.path, what)
        try:
            self._bind()
        except OSError as e:
            log.error("cannot re-create %s: %s; retrying next tick", self.path, e)

    def tick(self):
        """Every loop step: the socket checked, paused accepts and rate-held peers resumed."""
        self._guard()
        now = time.monotonic()
        if self._paused_until and now >= self._paused_until:
            self._paused_until = 0.0
            self.sel.register(self.sock, selectors.EVENT_READ, self._accept)
        for p in [p for p in self.held if self.buckets.ready(p.group)]:
            p.held = False
            self.held.discard(p)
            self._interest(p)
            self._drain(p)

    def _unlisten(self):
        try:
            self.sel.unregister(self.sock)
        except (KeyError, ValueError):
            pass

    # --- driven by the enforcer's loop: every registered object's data is a callback ---
    def _accept(self, _mask):
        for _ in range(64):   # a bounded batch: a flood of connects never starves the rest
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in NO_ROOM:   # out of fds or memory: shed the connection, stay up
                    self._unserved(e)
                    if not self.reserve.shed(self.sock):
                        self._unlisten()
                        self._paused_until = time.monotonic() + PAUSE_ACCEPT
                        return
                    continue
                if e.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EPERM, errno.EINTR):
                    continue
                log.error("accept on %s failed: %s", self.path, e)
                return
            self._admit(conn)

    def _unserved(self, e: OSError):
        self.refused += 1
        self.say("accept", logging.WARNING, "cannot serve a connection on %s (%s): closed unserved",
                 self.path, os.strerror(e.errno))

    def _admit(self, conn: socket.socket):
        conn.setblocking(False)
        try:
            ident = identify(conn)
        except OSError as e:   # no fd left for its pidfd
            self._unserved(e)
            ident = None
        if ident is None:      # (or gone before we got to it: nobody to serve)
            conn.close()
            return
        group, why = f"pid {ident.pid}", None
        if self.root_only and ident.uid != 0:
            why = "permission denied: the control socket is for root"
        else:
            try:
                group = self.group_of(ident)
            except Exception:   # its process went away while we looked
                why = "your process has exited"
            c = self.caps
            if why:
                pass
            elif len(self.peers) >= c.total:
                why = f"the enforcer serves {c.total} connections already; try again later"
            elif self.by_pid.get(ident.pid, 0) >= c.per_process:
                why = f"pid {ident.pid} has {c.per_process} connections open already (the cap per process)"
            elif self.by_group.get(group, 0) >= c.per_group:
                why = f"{group} has {c.per_group} connections open already (the cap per container)"
        if why:
            self.refused += 1
            self.say(group, logging.WARNING, "refused a connection of pid %d (%s) on %s: %s", ident.pid,
                     group, self.path, why)
            try:
                conn.send(_line({"ok": False, "error": why}))
            except OSError:
                pass
            conn.close()
            os.close(ident.pidfd)
            return
        peer = Peer(conn, ident.pid, ident.uid, ident.gid, ident, group)
        self.peers.add(peer)
        self.by_pid[peer.pid] = self.by_pid.get(peer.pid, 0) + 1
        self.by_group[group] = self.by_group.get(group, 0) + 1
        self.sel.register(conn, selectors.EVENT_READ, lambda mask, p=peer: self._io(p, mask))

    def _io(self, peer: Peer, mask):
        if mask & selectors.EVENT_WRITE:
            self._flush(peer)
        if mask & selectors.EVENT_READ and not peer.gone and not peer.held:
            try:
                data = peer.conn.recv(65536)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            if not data:
                self.drop(peer)
                return
            peer.buf += data
            self._drain(peer)

    def _drain(self, peer: Peer):
        """Every whole line buffered, while its group's request budget lasts."""
        limit = self.caps.line
        while not peer.gone:
            nl = peer.buf.find(b"\n", 0, limit + 1)
            if nl < 0:
                if len(peer.buf) > limit:
                    self.reply(peer, {"ok": False, "error": f"request longer than {limit} bytes"})
                    self._flush(peer)
                    self.drop(peer)
                break
            if not self.buckets.take(peer.group):
                self.say(peer.group, logging.WARNING, "%s sends more than %d requests a second: its "
                         "connections are read again when it is back under", peer.group, self.caps.rate)
                peer.held = True
                self.held.add(peer)
                self._interest(peer)
                break
            raw = bytes(peer.buf[:nl])
            del peer.buf[:nl + 1]
            self._dispatch(peer, raw)

    def _dispatch(self, peer: Peer, raw: bytes):
        if peer.ident is not None and peer.ident.exited():   # its pid may be another's now
            self.say(peer.group, logging.INFO, "pid %d has exited: its connection on %s is closed, "
                     "not served", peer.pid, self.path)
            self.drop(peer)
            return
        try:
            msg = json.loads(raw)
            if not isinstance(msg, dict):
                raise ValueError("not a JSON object")
        except (ValueError, RecursionError) as e:
            self.reply(peer, {"ok": False, "error": f"malformed request: {e}"})
            return
        try:
            answer = self.handler.handle(peer, msg)
        except Exception as e:   # one bad request never takes the daemon down
            self.say(peer.group, logging.WARNING, "request %.200r from pid %d failed: %s", raw, peer.pid, e)
            answer = {"ok": False, "error": str(e)}
        if answer is not DEFER:
            self.reply(peer, answer)

    def reply(self, peer: Peer, obj: dict):
        if peer.gone:
            return
        peer.out += _line(obj)
        if len(peer.out) > self.caps.out_bytes:   # it does not read: it gets nothing more
            self.say(peer.group, logging.WARNING, "pid %d (%s) left %d bytes of replies unread: "
                     "disconnected", peer.pid, peer.group, len(peer.out))
            self.drop(peer)
            return
        self._flush(peer)

    def _flush(self, peer: Peer):
        try:
            if peer.fds:
                n = socket.send_fds(peer.conn, [peer.out], peer.fds)
                peer.fds.clear()
            else:
                n = peer.conn.send(peer.out)
            del peer.out[:n]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self.drop(peer)
            return
        self._interest(peer)

    def _interest(self, peer: Peer):
        if peer.gone:
            return
        want = (0 if peer.held else selectors.EVENT_READ) | (selectors.EVENT_WRITE if peer.out else 0)
        key = self.sel.get_map().get(peer.conn)
        if not want:
            if key is not None:
                self.sel.unregister(peer.conn)
        elif key is None:
            self.sel.register(peer.conn, want, lambda mask, p=peer: self._io(p, mask))
        elif key.events != want:
            self.sel.modify(peer.conn, want, key.data)

    def drop(self, peer: Peer):
        if peer.gone:
            return
        peer.gone = True
        self.peers.discard(peer)
        self.held.discard(peer)
        for counts, k in ((self.by_pid, peer.pid), (self.by_group, peer.group)):
            counts[k] -= 1
            if not counts[k]:
                del counts[k]
        if peer.conn in self.sel.get_map():
            self.sel.unregister(peer.conn)
        peer.conn.close()
        try:
            self.handler.closed(peer)
        finally:
            if peer.ident is not None and peer.ident.pidfd >= 0:
                os.close(peer.ident.pidfd)

    def close(self):
        for p in list(self.peers):
            self.drop(p)
        self._unlisten()
        self.sock.close()
        self.reserve.close()
        try:
            if (os.lstat(self.path).st_ino, os.lstat(self.path).st_dev) == self.bound[::-1]:
                os.unlink(self.path)   # ours only: never a successor's
        except OSError:
            pass


def serve(sel: selectors.BaseSelector, timeout: float, servers=()) -> None:
    """Wait up to `timeout` for any registered socket (or other fd) and run its callback;
    then each server's tick."""
    for key, mask in sel.select(timeout):
        key.data(mask)
    for s in servers:
        s.tick()


def _line(obj: dict) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def request(path: str, msg: dict, timeout: float = 10.0) -> dict:
    """One request, one reply (the CLI's side)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        s.sendall(_line(msg))
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
    return json.loads(buf)
