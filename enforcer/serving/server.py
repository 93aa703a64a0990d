"""JSON-lines over a UNIX stream socket, for the enforcer's control socket (root: `convgpu
status`, `limit set`, `reload`, `run`) and the shim socket (issue "shim").

One request per line, one JSON object per reply line. The peer is who the kernel says it is
(SO_PEERCRED: pid, uid, gid), never what a message claims. A handler may answer later (a shim
waiting for memory): it returns DEFER and calls `Server.reply(peer, obj)` when ready. Malformed
or oversized input gets an error reply (oversized: and the connection closes); a client that
goes away mid-request is forgotten (`closed`) and nothing else is affected."""
import json
import logging
import os
import selectors
import socket
import struct
from dataclasses import dataclass, field

log = logging.getLogger(__name__)
DEFER = object()
MAX_LINE = 64 << 10


@dataclass(eq=False)
class Peer:
    conn: socket.socket
    pid: int
    uid: int
    gid: int
    buf: bytearray = field(default_factory=bytearray)
    out: bytearray = field(default_factory=bytearray)
    state: dict = field(default_factory=dict)   # per connection, for the handler
    fds: list = field(default_factory=list)     # passed (SCM_RIGHTS) with the next reply
    gone: bool = False


class Handler:
    """What a server serves: `handle` answers a dict (or DEFER); `closed` cleans up."""

    def handle(self, peer: Peer, msg: dict):
        raise NotImplementedError

    def closed(self, peer: Peer) -> None:
        pass


def peer_cred(conn: socket.socket) -> tuple[int, int, int]:
    pid, uid, gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                        struct.calcsize("3i")))
    return pid, uid, gid


class Server:
    def __init__(self, path: str, handler: Handler, mode: int = 0o600, root_only: bool = True,
                 sel: selectors.BaseSelector | None = None):
        self.path, self.handler, self.root_only = path, handler, root_only
        handler.server = self   # for replies it defers
        self.sel = sel or selectors.DefaultSelector()
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            os.unlink(path)     # a socket left by a dead enforcer
        except FileNotFoundError:
            pass
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK
                                  | socket.SOCK_CLOEXEC)
        old = os.umask(0o777 & ~mode)   # never world-reachable, not even between bind and chmod
        try:
            self.sock.bind(path)
        finally:
            os.umask(old)
        os.chmod(path, mode)
        self.sock.listen(128)
        self.sel.register(self.sock, selectors.EVENT_READ, self._accept)
        self.peers: set[Peer] = set()

    # --- driven by the enforcer's loop: every registered object's data is a callback ---
    def _accept(self, _mask):
        while True:
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            conn.setblocking(False)
            pid, uid, gid = peer_cred(conn)
            if self.root_only and uid != 0:
                conn.sendall(_line({"ok": False, "error": "permission denied: the control socket is for root"}))
                conn.close()
                continue
            peer = Peer(conn, pid, uid, gid)
            self.peers.add(peer)
            self.sel.register(conn, selectors.EVENT_READ, lambda mask, p=peer: self._io(p, mask))

    def _io(self, peer: Peer, mask):
        if mask & selectors.EVENT_WRITE:
            self._flush(peer)
        if mask & selectors.EVENT_READ and not peer.gone:
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
            while not peer.gone:
                nl = peer.buf.find(b"\n")
                if nl < 0:
                    if len(peer.buf) > MAX_LINE:
                        self.reply(peer, {"ok": False, "error": f"request longer than {MAX_LINE} bytes"})
                        self._flush(peer)
                        self.drop(peer)
                    break
                raw = bytes(peer.buf[:nl])
                del peer.buf[:nl + 1]
                self._dispatch(peer, raw)

    def _dispatch(self, peer: Peer, raw: bytes):
        try:
            msg = json.loads(raw)
            if not isinstance(msg, dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            self.reply(peer, {"ok": False, "error": f"malformed request: {e}"})
            return
        try:
            answer = self.handler.handle(peer, msg)
        except Exception as e:   # one bad request never takes the daemon down
            log.warning("request %.200r from pid %d failed: %s", raw, peer.pid, e)
            answer = {"ok": False, "error": str(e)}
        if answer is not DEFER:
            self.reply(peer, answer)

    def reply(self, peer: Peer, obj: dict):
        if peer.gone:
            return
        peer.out += _line(obj)
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
        want = selectors.EVENT_READ | (selectors.EVENT_WRITE if peer.out else 0)
        self.sel.modify(peer.conn, want, self.sel.get_key(peer.conn).data)

    def drop(self, peer: Peer):
        if peer.gone:
            return
        peer.gone = True
        self.peers.discard(peer)
        self.sel.unregister(peer.conn)
        peer.conn.close()
        self.handler.closed(peer)

    def close(self):
        for p in list(self.peers):
            self.drop(p)
        self.sel.unregister(self.sock)
        self.sock.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass


def serve(sel: selectors.BaseSelector, timeout: float) -> None:
    """Wait up to `timeout` for any registered socket (or other fd) and run its callback."""
    for key, mask in sel.select(timeout):
        key.data(mask)


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
