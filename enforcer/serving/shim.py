"""The shim socket's protocol (shim/shim.c is the other side), on top of enforcer/serving/server.py.
Every message is checked; the caller is the process the kernel names (enforcer/serving/peers.py),
whatever a message says. Decisions are the broker's (enforcer/serving/broker.py). Per process: its
live objects (address -> host GPU, size), so a free is counted once and only for what that process
allocated. A process is its pid and start time, not its pid: state left by a process whose pid
now belongs to another is forgotten before the new one's first hello counts (issue 24, row 9)."""
import logging

from ..tenants.containers import _start_time
from .server import DEFER, Handler, Peer

log = logging.getLogger(__name__)
MAX_SIZE = 1 << 50   # 1 PiB: anything larger is not a request, it is garbage
# Live allocations remembered per process (issue 24, row 6). PyTorch's caching allocator holds
# a few thousand blocks at most; past this an allocation is still charged (by BPF, or by the
# ledger), but its free is not recognised: its bytes stay charged to its own container until
# the process exits. Nobody else's books change.
MAX_OBJECTS = 1 << 16


class ShimHandler(Handler):
    def __init__(self, broker):
        self.broker = broker
        self.server = None                                        # set by Server
        broker.forget = self.forget
        Proc = tuple[int, int]                                    # (pid, start time)
        self.objects: dict[Proc, dict[int, tuple[int, int]]] = {}  # addr -> (host GPU, size)
        self.conns: dict[Proc, int] = {}                          # open connections that said hello
        self.owner: dict[int, int] = {}                           # pid -> start time of its shim process

    def handle(self, peer: Peer, msg: dict):
        op = msg.get("op")
        if op == "status":   # the caller's own container and nothing of anyone else's (docs/TENANT.md)
            return {"ok": True, "status": self.broker.own_status(peer.ident)}
        if op == "hello":
            if not peer.state.get("hello"):
                proc = self._proc(peer)
                if self.owner.get(peer.pid, proc[1]) != proc[1]:   # a reused pid: the old one is gone
                    self.broker.shim_gone(peer.pid)
                self.owner[peer.pid] = proc[1]
                peer.state["hello"] = proc
                self.conns[proc] = self.conns.get(proc, 0) + 1
            answer, page = self.broker.shim_hello(peer.pid)
            peer.fds.append(page)   # the credit page goes with the reply (shim/credit.h)
            return {"ok": True, **answer}
        if not peer.state.get("hello"):
            return {"ok": False, "error": "say hello first"}
        if peer.state.get("asking"):
            return {"ok": False, "error": "one request at a time per connection"}
        if op == "ask":
            dev, size = self._dev(peer, msg), _int(msg, "size", 0, MAX_SIZE)
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
            dev, addr, size = self._dev(peer, msg), _int(msg, "addr", 0, 2**64 - 1), _int(msg, "size", 0, MAX_SIZE)
            objects = self.objects.setdefault(peer.state["hello"], {})
            if addr and (addr in objects or len(objects) < MAX_OBJECTS):
                objects[addr] = (dev, size)
            elif addr and not peer.state.get("full"):
                peer.state["full"] = True
                log.warning("pid %d reports more than %d live allocations: later ones are charged but "
                            "their frees not counted until it exits", peer.pid, MAX_OBJECTS)
            self.broker.shim_alloc(peer.pid, dev, addr, size)
            return DEFER
        if op == "free":
            addr = _int(msg, "addr", 0, 2**64 - 1)
            obj = self.objects.get(peer.state["hello"], {}).pop(addr, None)
            if obj is not None:   # unknown addresses were not ours to count
                self.broker.shim_free(peer.pid, obj[0], addr, obj[1])
            return DEFER
        if op == "ctx":     # a context was made (no reply): counted here only without probes
            self.broker.shim_context(peer.pid, self._dev(peer, msg), bool(_int(msg, "primary", 0, 1)))
            return DEFER
        if op == "meminfo":
            dev = self.broker.by_minor(_int(msg, "minor", 0, 1 << 20)) if "minor" in msg else self._dev(peer, msg)
            if dev not in self.broker.capacity:
                return {"ok": False, "error": f"no GPU {dev} under the enforcer"}
            total, used = self.broker.shim_meminfo(peer.pid, dev)
            return {"ok": True, "total": total, "used": used}
        return {"ok": False, "error": f"unknown op {op!r}"}

    def _dev(self, peer: Peer, msg: dict) -> int:
        """The host GPU a message names: its `dev` is the process's own CUDA ordinal (issue 25)."""
        return self.broker.host(peer.pid, _int(msg, "dev", 0, 63))

    def _proc(self, peer: Peer) -> tuple[int, int]:
        start = _start_time(peer.pid, "/proc")
        if peer.ident is not None and peer.ident.exited():   # the stat read may be of its successor
            raise LookupError(f"pid {peer.pid} has gone")
        return peer.pid, start

    def closed(self, peer: Peer):
        proc = peer.state.get("hello")
        if not proc:
            return
        self.conns[proc] -= 1
        if self.conns[proc]:
            return
        del self.conns[proc]
        if peer.ident.exited():   # a thread's exit is not the process's
            self.objects.pop(proc, None)
            if self.owner.get(proc[0]) == proc[1]:
                self.broker.shim_gone(proc[0])

    def forget(self, pid: int):
        """The broker's word that pid's shim process is gone (its exit, or a successor's hello)."""
        start = self.owner.pop(pid, None)
        if start is not None:
            self.objects.pop((pid, start), None)


def _int(msg: dict, key: str, lo: int, hi: int) -> int:
    v = msg.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise ValueError(f"{key} must be an integer in [{lo}, {hi}], not {v!r}")
    return v

