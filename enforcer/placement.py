"""Placement: a process's first CUDA call places it in its container (a Box, a first assignment
on the device), a stall makes it a waiter, and a process gone takes it out of its container
(the container's last: its assignment goes back to the pool)."""
import logging
import signal
import time

from ..faults import FAULT
from ..probes.events import EF_ORDINAL, EF_RESERVED
from ..units import format_size
from . import policies
from .books import Ask, Box, Wait
from .failsafe.stall import SignalStopper

log = logging.getLogger(__package__ + ".daemon")   # the Enforcer logs as one: "daemon: ..." (bench/sched, tests read it)


class Placement:
    """Who is in which container, and who waits. Handed the tracer (per-process usage, GPU
    mappings), the books (it adds and removes containers, members and waits), BpfMaps
    (memberships, counters, assignments), the Actuator (a waiter is held; a container thawed),
    revoke(box, dev) (ShimCredit: credit back before a wait is recorded), Quotas (the process
    quota, the buckets), Runtime (the rules, the names, a decision left at a cgroup), the
    history (a container's run ends), hold_newcomer(e, also) (ContextCharge: a GPU whose
    context is being measured holds its newcomers), container_of(pid), the engines' lookup,
    --unmapped-charge, and over_limit() (the decider's)."""

    def __init__(self, tracer, books, maps, actuator, revoke, quotas, runtime, history, hold_newcomer,
                 container_of, engines, unmapped_charge: str, over_limit):
        self.tracer, self.books, self.maps, self.actuator, self.revoke = tracer, books, maps, actuator, revoke
        self.quotas, self.runtime, self.history, self.hold_newcomer = quotas, runtime, history, hold_newcomer
        self.container_of, self.engines, self.unmapped_charge, self.over_limit = (container_of, engines,
                                                                                   unmapped_charge, over_limit)
        self.freezer = not isinstance(actuator.stopper, SignalStopper)

    def first_call(self, e) -> bool:
        """BPF stopped an unplaced process at its first call (op "unknown"); True if placed."""
        also = ()
        if e.flags & EF_ORDINAL:    # its first placement: map its ordinals first
            m = self.tracer.map_gpus(e.pid, self.unmapped_charge == "all")
            e, also = e._replace(dev=m.host(e.dev)), m.also if self.unmapped_charge == "all" else ()
        if e.restall:
            self.restalled(e)
        if self.hold_newcomer(e, also):   # a GPU never seen: its context is measured first
            return False
        self.place(e.pid, max(e.dev, 0), e.size, e.tid, e.result, also)
        return True

    def stalled(self, e, now: float):
        """BPF stopped a member's call (op "stall", or "over_limit": it can never fit)."""
        box = self.books.by_key.get(e.addr)
        if box is not None and e.op == "over_limit" and self.over_limit() == "kill":
            # BPF killed it (stop_then_tell): nothing waits, and its exit may come in this batch
            box.over_limits += 1
            log.warning("container %s GPU%d: pid %d needs %s for its %s, above its limit %s: killed "
                        "before it ran", box.name, max(e.dev, 0), e.pid, format_size(e.size), e.api,
                        format_size(self.books.limit(box, max(e.dev, 0))))
        elif box is not None:
            if e.restall:
                self.restalled(e, box)
            else:
                log.info("stall %s pid %d on GPU%d: %s %s would bring it to %s (assigned %s)",
                         box.name, e.pid, max(e.dev, 0), e.api, format_size(e.size),
                         format_size(e.live), format_size(box.assigned.get(max(e.dev, 0), 0)))
            self.waiter(box, max(e.dev, 0), e.pid, 0, ask=Ask(e.pid, e.tid, e.size, now, e.result,
                                                              over_limit=e.op == "over_limit",
                                                              reserved=bool(e.flags & EF_RESERVED)))

    def box_for(self, pid: int, keep: bool = True) -> Box | None:
        """pid's budget's record, made where there is none (Runtime.budget: its container's own,
        or the budget of the DRA claims that bind it, shared by every container that uses them).
        keep=False: a record made here is not kept (a shim's message from a process that has
        opened no GPU, issue 39 attack 1: each such message used to leave a record with an
        assignment and no process, for good)."""
        try:
            c = self.container_of(pid)
        except Exception:
            return None
        books, runtime = self.books, self.runtime
        box = books.member_box(c.id)
        if box is not None:
            return box
        if keep:
            runtime.new_container(c)   # a new cgroup where a gone one was decided for
        ident, bound = runtime.budget(c)
        box = books.boxes.get(ident.id)
        if box is not None:   # a claim's budget: c is one more of its containers
            runtime.take_claims(box, bound)
            return box
        meta = self.engines.lookup_sync(c) if self.engines is not None and ident is c else None
        name = (meta.name if meta and meta.name else runtime.name_of(c.cgroup, c.short)) if ident is c \
            else runtime.budget_name(bound)
        box = Box(books.new_key() if keep else 0, ident, name, time.monotonic(), 0, "",
                  labels=meta.labels if meta else None)
        box.members[c.id] = c
        runtime.take_claims(box, bound)
        limit, box.source = runtime.limit_of(box)
        box.limit = books.capped(name, limit)
        if not keep:
            return box
        books.boxes[ident.id] = box
        books.by_key[box.key] = box
        log.info("container %s (%s): limit %s from %s", name, ident.kind, format_size(box.limit), box.source)
        usage = self.tracer.usage()   # its other processes that already use the GPU join too
        for u in {u.pid for u in usage} - set(books.pid_box) - {pid}:
            try:
                other = self.container_of(u)
                if other.id == c.id or (bound and books.member_box(other.id) is None
                                        and runtime.budget(other)[0].id == ident.id):
                    self.join(box, u, usage=usage, c=other)
            except Exception:
                pass
        return box

    def place(self, pid: int, dev: int, request: int, tid: int = 0, seq: int = 0, also=()):
        """also: the other GPUs it may be using (its mapping is not established: BPF charges
        its bytes there too, into the container's state on each)."""
        box = self.box_for(pid)
        if box is None:     # gone before we could place it: nothing to hold
            self.actuator.signal((pid,), signal.SIGCONT)
            return
        if self.quotas.process_full(box, pid):   # `members` is bounded too (enforcer/quotas.py)
            return
        self.join(box, pid, dev, request)
        for d in sorted(set(also) & set(self.books.capacity) - set(box.assigned)):
            self.new_device(box, d)
        if FAULT:
            FAULT.hit("place")   # a member with an assignment in BPF, no waiter recorded yet
        self.waiter(box, dev, pid, 0, count=False,
                    ask=Ask(pid, tid or pid, request, time.monotonic(), seq,
                            over_limit=request > self.books.limit(box, dev), first=True))
        if self.books.demand(box, dev) > box.assigned[dev]:   # placed, but nothing to run on yet
            box.stalls += 1
            log.info("stall %s pid %d on GPU%d: placed with %s assigned, needs %s", box.name, pid,
                     dev, format_size(box.assigned[dev]), format_size(self.books.demand(box, dev)))

    def join(self, box: Box, pid: int, dev: int | None = None, request: int = 0, usage=None, c=None):
        """pid (of container c, looked up where not given) is in box from now on. What it
        allocated before (while no enforcer admitted, or in calls that are not admitted) was
        charged to no container: adopt it. Read before the membership is written, so a racing
        free can only make this an over-count. A member placed again (its first context on
        another GPU) adopts nothing on the GPUs the box has: BPF charged its bytes there already."""
        charged = set(box.assigned) if self.books.pid_box.get(pid) is box else set()
        held = {u.dev: (u.live, max(u.contexts, 0)) for u in (usage or self.tracer.usage())
                if u.pid == pid and u.dev not in charged and (u.live or u.contexts > 0)}
        self.quotas.ensure(box)
        if c is None:
            try:
                c = self.container_of(pid)
            except Exception:
                c = None   # gone meanwhile: its exit takes it out again
        self.maps.set_member(pid, box.key)
        box.add(pid, c)
        self.books.pid_box[pid] = box
        for d in sorted(set(held) | ({dev} if dev is not None else set())):
            if d not in box.assigned:
                self.new_device(box, d, request if d == dev else 0)
        for d, (nbytes, nctx) in held.items():
            b0, c0 = box.adopted.get(d, (0, 0))
            box.adopted[d] = (b0 + nbytes, c0 + nctx)
            self.maps.write_assign(box, d)
            log.info("container %s GPU%d: pid %d already held %s in %d contexts: adopted", box.name,
                     d, pid, format_size(nbytes), nctx)

    def new_device(self, box: Box, dev: int, request: int = 0):
        """First context of a container on a device: A_c = min(L_c, unassigned), cut to what
        keeps the device safe, 0 (it waits) where even the call it is stopped at (`request`,
        on top of what it already holds) is not (policies.assign_new)."""
        books = self.books
        free = books.free(dev)
        held = books.held(box, dev)
        box.assigned[dev] = policies.assign_new(books.limit(box, dev), free, books.claims(dev, but=box),
                                                books.capacity.get(dev, 0), held, held + request,
                                                box.container.id)
        self.maps.ensure_state(box, dev)
        self.maps.write_assign(box, dev)
        log.info("container %s GPU%d: assigned %s (limit %s)", box.name, dev,
                 format_size(box.assigned[dev]), format_size(books.limit(box, dev)))

    def waiter(self, box: Box, dev: int, pid: int, unreserved: int, count: bool = True,
               ask: Ask | None = None) -> Wait:
        """A shim request (unreserved bytes) or a stopped call (ask) waits on dev."""
        self.revoke(box, dev)   # credit of the container's shim processes: for the waiter
        w = box.waiting.get(dev)
        if w is None:
            now = time.monotonic()
            w = box.waiting[dev] = Wait(now, set(), freed_at=now, held_was=self.books.taken(box, dev))
            box.stalls += count
        if pid in self.books.shimmed:
            w.unreserved += unreserved
        if ask is not None:   # a re-stall replaces its thread's ask (the same call)
            box.going.get(dev, {}).pop(ask.tid, None)
            old = w.asks.get(ask.tid)
            w.asks[ask.tid] = ask if old is None else Ask(ask.pid, ask.tid, ask.size, old.since, ask.seq, ask.over_limit,
                                                          reserved=ask.reserved)
        w.pids.add(pid)
        self.actuator.hold(box, pid, ask)
        return w

    def killed_unchecked(self, e):
        """BPF killed a thread at a call no stop could hold (bpf stop_then_tell, issue 33): one
        traced by another process (which sees a SIGSTOP first and may drop it: attack 2), or one
        the full `threads` map leaves no entry to check its call with."""
        box = self.books.pid_box.get(e.pid)
        who = f"pid {e.pid} thread {e.tid}" + (f" of {box.name}" if box else "")
        if e.op == "full":
            log.warning("%s: the BPF threads map is full, so its %s cannot be tracked: killed before it "
                        "ran (more containers at their thread quotas than the maps hold; see --max-threads)",
                        who, e.api)
        else:
            log.warning("%s: traced by pid %d, not convgpu, which can swallow a stop: %s before its %s ran",
                        who, e.result, "stopped at entry, it ran on without a grant; killed" if e.restall
                        else "killed", e.api)

    def restalled(self, e, box: Box | None = None):
        if box is not None:
            box.restalls += 1
        log.warning("pid %d%s resumed without a grant (SIGCONT from outside?): stopped again "
                    "before its %s ran", e.pid, f" of {box.name}" if box else "", e.api)

    def gone(self, pid: int):
        """pid left (an exit, or an exec: a new image starts unplaced)."""
        books = self.books
        box = books.pid_box.pop(pid, None)
        if box is None:
            return
        frozen = bool(box.waiting) and self.freezer   # a wait froze it whole
        cgroups = box.cgroups
        left = box.drop(pid)
        box.placed.pop(pid, None)
        box.settling.discard(pid)
        settled = False
        self.actuator.holds.forget(pid)
        for going in box.going.values():
            for t in [t for t, a in going.items() if a.pid == pid]:
                del going[t]
        for dev, w in list(box.waiting.items()):
            w.pids.discard(pid)
            w.asks = {t: a for t, a in w.asks.items() if a.pid != pid}
            if not w.pids:
                del box.waiting[dev]
                settled = True
        if settled and box.pids and not box.waiting and self.freezer:
            self.actuator.thaw(box)   # its last wait went with the process: the others run again
        if left is not None and box.pids and self.freezer:   # a member of a shared budget left
            self.actuator.thaw_emptied(box, frozen, (left.cgroup,))   # (the next process there must not freeze)
        if not box.pids:     # the container's last process: its assignment returns to the pool
            self.maps.drop_container(box)
            self.quotas.drop(box)
            del books.boxes[box.container.id]
            del books.by_key[box.key]
            self.history.ended(box.container.id)   # its run goes to the job history
            log.info("container %s exited: %s back to the pool", box.name,
                     format_size(sum(box.assigned.values())))
            if self.freezer:
                self.actuator.thaw_emptied(box, frozen, cgroups)

    def group_of(self, ident) -> str:
        """A shim peer's container, for the caps per container (serving/peers.py)."""
        c = self.container_of(ident.pid)
        if ident.exited():   # what we read may be of a process that took its pid since
            raise ProcessLookupError(ident.pid)
        return f"{c.kind} {c.id}"

    def place_stray(self, pid: int, dev: int) -> Box | None:
        """The backstop's: a process that shows it holds memory NVML counts on GPU dev, never
        placed (no admitted call), joins its container there (enforcer/attribution.py)."""
        box = self.box_for(pid)
        if box is None or self.quotas.process_full(box, pid):
            return None
        self.join(box, pid, dev)
        log.warning("pid %d of %s holds GPU memory and made no call convgpu admits: placed by what it holds",
                    pid, box.name)
        return box
