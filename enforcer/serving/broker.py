"""The enforcer's answers to processes under the preload shim (issue "shim"): the shim asks before
each allocation and waits in the calling thread, or gets a real out-of-memory error, instead of
being stopped. enforcer/serving/shim.py speaks the socket protocol and calls these methods.

With probes active there is one accounting: BPF charges the shim process's bytes as for any
other process (its `members` entry carries SHIM_MEMBER, so BPF does not stop the calls it makes
from inside a shim wrapper, serving/shimprobes.py, below its limit), and a grant is
held here as *pending* until the shim reports the allocation (then BPF has charged it).
Without probes (`--no-probes`) the reports themselves are the accounting: they go to the
ledger (probes/ledger.py), which keeps the same tables BPF would.

After a grant the process also gets *credit* (enforcer/serving/credit.py, ShimCredit): half of what
its container has left on the device, which its next allocations take without asking. Credit is
pending too (pending = credit unspent + taken but not yet reported), and every unspent byte of the
container comes back (`revoke`) before any other request of it is decided."""
import logging
import time

from ...probes import gpumap
from ...probes.ledger import DEV_PAGE, SUBALLOC_MAX, footprint
from ...units import format_size
from .. import ctxest
from . import memview
from .peers import SHIM_CAPS, LogBudget

log = logging.getLogger(__name__)


class ShimBroker:
    """Handed the tracer (or the ledger, --no-probes: then the shims' reports are the
    accounting), the books, the shim processes' credit (ShimCredit), Placement (a shim process
    is placed and waits as any other), BpfMaps (its `members` entry carries SHIM_MEMBER), the
    decider's schedule(), the context charges (what the shim's view leaves for a context),
    take(events, now) (the enforcer's event router: an exec the ledger saw first) and
    --unmapped-charge."""

    def __init__(self, tracer, books, credit, placement, maps, schedule, charges, take, unmapped_charge: str):
        self.tracer, self.books, self.credit, self.placement, self.maps = tracer, books, credit, placement, maps
        self.schedule, self.charges, self.take, self.unmapped_charge = schedule, charges, take, unmapped_charge
        self.capacity = books.capacity
        self.ledger = None if tracer.kernel else tracer   # no probes: we account
        self.asks = 0                              # requests that had to be decided here
        self.forget = lambda pid: None             # the socket side's per-process state (shim.py)
        self.say = LogBudget(SHIM_CAPS.log_lines, log)  # asks are a container's to repeat: lines per minute

    def _box(self, pid: int):
        if self.ledger is not None:   # an exec not yet read from the connector: the old image leaves first
            e = self.ledger.exec_seen(pid)
            if e is not None:
                self.take([e], time.monotonic())
        box = self.books.pid_box.get(pid)
        if box is None:
            mapped = self._mapped(pid)
            # not a member yet, and it has opened no GPU: BPF places (and maps) it at its first
            # call; its messages until then are answered from a record that is not kept
            box = self.placement.box_for(pid, keep=mapped)
            if box is None:
                raise LookupError(f"pid {pid} has gone")
            if not mapped:
                return box
            self.placement.join(box, pid)
        if pid not in self.books.shimmed:
            if not self._mapped(pid):
                return box
            for dev in self.capacity:   # charged from its first call, asked for or not (contexts)
                self.maps.ensure_state(box, dev)
            self.maps.set_member(pid, box.key, shim=True)
            self.books.shimmed.add(pid)
            if self.ledger is not None:
                self.ledger.watch(pid)
            log.info("pid %d of %s uses the shim: it waits (or fails) instead of stopping", pid, box.name)
        return box

    def _mapped(self, pid: int) -> bool:
        """Whether pid's CUDA ordinals are host GPUs in BPF's gpumap, so that it may be a member
        (whose calls BPF charges without stopping it at placement). A shim says hello before its
        first context, possibly before cuInit (an NVML query first): then nothing it opened tells
        its GPUs yet, and it stays out of `members`; its first driver call stops for placement
        as anyone's, which maps it (Placement.first_call), and its next message makes it a shim
        member. Before that, a process that said hello and called the driver outside the shim
        was charged on its ordinals as host GPUs: on GPU 0 for a process given GPU 1."""
        tr = self.tracer
        if self.ledger is not None or not tr.gpumap.gpus or pid in tr.mapped:
            return True
        if not gpumap.opened_minors(pid, tr.gpumap.major):
            return False
        tr.map_gpus(pid, self.unmapped_charge == "all")
        return True

    def host(self, pid: int, ordinal: int) -> int:
        """The host GPU behind pid's CUDA ordinal: the shim speaks the process's own ordinals, the
        books host GPUs (probes/gpumap.py; the mapping BPF was given at its placement, or read now
        from its device nodes: a message naming a device comes after cuInit opened them)."""
        g = self.tracer.gpumap
        return g.host(pid, ordinal) if g.gpus else ordinal

    def by_minor(self, minor: int) -> int:
        """The host GPU whose /dev/nvidiaN has this minor (the shim's NVML wrappers name GPUs so),
        -1 for none; without NVML's facts, the minor as the index (one GPU, minor 0)."""
        gpus = self.tracer.gpumap.gpus
        return next((g.index for g in gpus if g.minor == minor), -1) if gpus else minor

    def shim_hello(self, pid: int) -> tuple[dict, int]:
        """The reply, and the process's credit page to pass with it."""
        box = self._box(pid)
        page = self.credit.page(pid, DEV_PAGE, SUBALLOC_MAX)
        return ({"limit": box.limit, "credit": page.id,
                 "devices": {str(d): min(self.books.limit(box, d), cap) for d, cap in sorted(self.capacity.items())}},
                page.fd)

    def shim_ask(self, pid: int, dev: int, size: int, wake):
        books = self.books
        box = self._box(pid)
        if dev not in self.capacity:
            return {"deny": f"no GPU{dev} under the enforcer"}
        if books.pid_box.get(pid) is not box:   # an allocation comes after cuInit opened its GPUs
            return {"deny": f"pid {pid} has opened no GPU: nothing to allocate on"}
        if dev not in box.assigned:
            self.placement.new_device(box, dev)
        self.asks += 1
        self.credit.revoke(box, dev)
        size = footprint(size)   # what it will be charged: whole device pages above 1 MiB
        need = books.demand(box, dev) + size
        if need > books.limit(box, dev):
            box.over_limits += 1
            self.say(box.name, logging.WARNING, "deny %s pid %d on GPU%d: %s would bring it to %s, above its "
                     "limit %s", box.name, pid, dev, format_size(size), format_size(need),
                     format_size(books.limit(box, dev)))
            return {"deny": f"{box.name}: {format_size(need)} is above its limit {format_size(books.limit(box, dev))}"}
        if need <= box.assigned[dev]:
            self.credit.hold(box, pid, dev, size)
            self.credit.give(box, pid, dev)
            return {"grant": True}
        w = self.placement.waiter(box, dev, pid, size)
        w.wakes.append((pid, size, lambda answer: self._answered(box, pid, dev, size, wake, answer)))
        self.say(box.name, logging.INFO, "stall %s pid %d on GPU%d (shim, waits in its thread): %s would bring it to %s "
                 "(assigned %s)", box.name, pid, dev, format_size(size), format_size(need),
                 format_size(box.assigned[dev]))
        self.schedule()
        return None

    def _answered(self, box, pid: int, dev: int, size: int, wake, answer: dict):
        """The scheduler resumed (or refused) a shim waiter (Actuator.answer_shim)."""
        if answer.get("grant"):
            self.credit.hold(box, pid, dev, size)
            self.credit.give(box, pid, dev)
        wake(answer)

    def unspent(self, box, dev: int) -> int:
        return self.credit.unspent(box, dev)

    def shim_alloc(self, pid: int, dev: int, addr: int, size: int):
        if self.ledger is not None and addr:
            self.ledger.alloc(pid, dev, size)
        self.credit.settle(pid, dev, footprint(size))   # charged by now (BPF, or the ledger just above)

    def shim_free(self, pid: int, dev: int, addr: int, size: int):
        if self.ledger is not None:
            self.ledger.free(pid, dev, size)
        self.schedule()            # the bytes are off; room for a waiter?

    def shim_context(self, pid: int, dev: int, primary: bool):
        if self.ledger is not None:    # with probes, BPF counts contexts itself
            self._box(pid)
            self.ledger.context(pid, dev, primary)

    def shim_meminfo(self, pid: int, dev: int) -> tuple[int, int]:
        """(total, used) by the rule of enforcer/serving/memview.py: the limit less this process's
        context; used, what the container holds besides it (unspent credit is not held)."""
        books = self.books
        box = self._box(pid)
        used, nctx, reserved = books.usage(box, dev)
        used -= (used >> 63) << 64           # BPF's counter may have wrapped below zero
        w = box.waiting.get(dev)
        allocated = (used + reserved + box.shim_pending.get(dev, 0) + (w.unreserved if w else 0)
                     - self.credit.unspent(box, dev))
        if box.pids <= {pid}:    # alone in its container: its contexts are the container's
            contexts = {pid: nctx}
        else:                    # a walk of BPF's usage map: only where there are others to tell apart
            contexts = {u.pid: u.contexts for u in self.tracer.usage() if u.dev == dev and u.pid in box.pids}
        excess = self.charges.excess
        procs = {q: memview.ProcContexts(max(contexts.get(q, 0), 0), excess.get((q, dev))) for q in box.pids}
        return memview.view(min(books.limit(box, dev), self.capacity.get(dev, 0)), allocated, procs, pid,
                            self.ceiling(dev).bytes)

    def own_status(self, ident) -> dict:
        """`convgpu status --mine` from inside a container (docs/TENANT.md): the container of
        the process the kernel names (its cgroup, read while its pid is proven its own), its
        limit and, per GPU, what it uses, was assigned and waits for. Nothing of another
        container: no names, no card-wide figures (docs/SECURITY.md, row 19)."""
        c = self.placement.container_of(ident.pid)
        if ident.exited():   # what we read may be of a process that took its pid since
            raise ProcessLookupError(ident.pid)
        box = self.books.boxes.get(c.id)
        if box is None:
            limit, source = self.placement.runtime.rules.limit_for(c, self.placement.runtime.name_of(c.cgroup, c.short),
                                                                   None)
            return {"container": c.short, "limit": limit, "source": source, "gpus": {},
                    "note": "no CUDA call from this container yet: its limit applies from its first"}
        now, books = time.monotonic(), self.books
        gpus = {}
        for dev in sorted(box.assigned):
            w = box.waiting.get(dev)
            gpus[str(dev)] = {"limit": books.limit(box, dev), "assigned": box.assigned[dev],
                              "used": books.held(box, dev), "needs": books.demand(box, dev),
                              "context": self.charges.ctx(dev), "waiting": w is not None,
                              "waiting_s": round(now - w.since, 1) if w else 0.0,
                              "over_limit": bool(w and w.over_limit)}
        return {"container": box.name, "limit": box.limit, "source": box.source, "gpus": gpus}

    def ceiling(self, dev: int) -> ctxest.Estimate:
        """What a context not yet measured on dev counts in a reported total (ctxest.ceiling)."""
        est = self.charges.estimate(dev)
        if dev not in self.charges.devices:
            return ctxest.ceiling(ctxest.Device(dev), est, DEV_PAGE)
        return ctxest.ceiling(self.charges.devices[dev], est, DEV_PAGE)

    def caught(self, pid: int):
        """BPF stopped pid, a shim user, at a call it made outside the shim's wrappers (or above
        its limit): from now on it is stopped and resumed like any process (resumes skip shim
        users, which wait in their threads), until it says hello again."""
        box = self.books.pid_box.get(pid)
        self.say(box.name if box else str(pid), logging.WARNING, "pid %d%s called the driver outside the "
                 "shim (or above its limit): BPF stopped it; it is stopped and resumed like any process",
                 pid, f" of {box.name}" if box else "")
        self.shim_gone(pid)
        if box is not None:
            self.maps.set_member(pid, box.key)

    def shim_gone(self, pid: int):
        self.forget(pid)
        self.credit.drop(pid)
        self.books.shimmed.discard(pid)
        box = self.books.pid_box.get(pid)
        if box is not None:
            for w in box.waiting.values():
                w.wakes[:] = [x for x in w.wakes if x[0] != pid]
        self.schedule()
