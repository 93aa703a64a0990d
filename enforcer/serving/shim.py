"""The shim socket's protocol (shim/shim.c is the other side), on top of enforcer/serving/server.py.
Every message is checked; the caller is the pid SO_PEERCRED gives, whatever a message says.
Decisions are the broker's (enforcer/serving/broker.py). Per process: its live objects (address ->
device, size), so a free is counted once and only for what that process allocated."""
import logging

from .server import DEFER, Handler, Peer

log = logging.getLogger(__name__)
MAX_SIZE = 1 << 50   # 1 PiB: anything larger is not a request, it is garbage


class ShimHandler(Handler):
    def __init__(self, broker):
        self.broker = broker
        self.server = None                                        # set by Server
        self.objects: dict[int, dict[int, tuple[int, int]]] = {}  # pid -> addr -> (dev, size)
        self.conns: dict[int, int] = {}                           # pid -> open connections

    def handle(self, peer: Peer, msg: dict):
        op = msg.get("op")
        if op == "hello":
            if not peer.state.get("hello"):
                peer.state["hello"] = True
                self.conns[peer.pid] = self.conns.get(peer.pid, 0) + 1
            answer, page = self.broker.shim_hello(peer.pid)
            peer.fds.append(page)   # the credit page goes with the reply (shim/credit.h)
            return {"ok": True, **answer}
        if not peer.state.get("hello"):
            return {"ok": False, "error": "say hello first"}
        if peer.state.get("asking"):
            return {"ok": False, "error": "one request at a time per connection"}
        if op == "ask":
            dev, size = _int(msg, "dev", 0, 63), _int(msg, "size", 0, MAX_SIZE)
            peer.state["asking"] = True

            def wake(answer, peer=peer):
                peer.state["asking"] = False
                self.server.reply(peer, {"ok": True, **answer})
            answer = self.broker.shim_ask(peer.pid, dev, size, wake)
            if answer is None:
                return DEFER   # the reply comes when the scheduler grants (or refuses)
            peer.state["asking"] = False
            return {"ok": True, **answer}
        if op == "alloc":   # reported after the call: no reply (the shim does not wait)
            dev, addr, size = _int(msg, "dev", 0, 63), _int(msg, "addr", 0, 2**64 - 1), _int(msg, "size", 0, MAX_SIZE)
            if addr:
                self.objects.setdefault(peer.pid, {})[addr] = (dev, size)
            self.broker.shim_alloc(peer.pid, dev, addr, size)
            return DEFER
        if op == "free":
            addr = _int(msg, "addr", 0, 2**64 - 1)
            obj = self.objects.get(peer.pid, {}).pop(addr, None)
            if obj is not None:   # unknown addresses were not ours to count
                self.broker.shim_free(peer.pid, obj[0], addr, obj[1])
            return DEFER
        if op == "ctx":     # a context was made (no reply): counted here only without probes
            self.broker.shim_context(peer.pid, _int(msg, "dev", 0, 63), bool(_int(msg, "primary", 0, 1)))
            return DEFER
        if op == "meminfo":
            total, used = self.broker.shim_meminfo(peer.pid, _int(msg, "dev", 0, 63))
            return {"ok": True, "total": total, "used": used}
        return {"ok": False, "error": f"unknown op {op!r}"}

    def closed(self, peer: Peer):
        if not peer.state.get("hello"):
            return
        self.conns[peer.pid] -= 1
        if self.conns[peer.pid] == 0 and not _alive(peer.pid):   # a thread's exit is not the process's
            del self.conns[peer.pid]
            self.objects.pop(peer.pid, None)
            self.broker.shim_gone(peer.pid)


def _int(msg: dict, key: str, lo: int, hi: int) -> int:
    v = msg.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise ValueError(f"{key} must be an integer in [{lo}, {hi}], not {v!r}")
    return v


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
