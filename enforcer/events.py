"""Events in: a process's first CUDA call places it in its container (a Box, a first
assignment on the device), a stall makes it a waiter, an exit (and its pidfd, when the driver
has freed its memory) takes it out of the books."""
import ctypes as ct
import logging
import os
import select
import selectors
import signal
import time

from ..faults import FAULT
from ..probes.events import EF_ORDINAL, EF_RESERVED, EF_TRACED
from ..probes.table import INDIRECT
from ..units import format_size
from . import policies
from .actions import alive
from .books import Ask, Box, Exit, Wait
from .failsafe.stall import SignalStopper, Target

log = logging.getLogger(__package__ + ".daemon")   # the Enforcer logs as one: "daemon: ..." (bench/sched, tests read it)
EXIT_WAIT = 10.0         # s an exit waits for its pidfd (a pid reused meanwhile never fires it)


class Events:
    """Part of Enforcer (enforcer/daemon.py): placement, stalls and exits as the probes report them."""

    def _take(self, events, now: float) -> bool:
        """The probes' events and the exits whose pidfd fired (or that waited EXIT_WAIT) into
        the books; True if that changed what schedule() may decide."""
        dirty = False
        if self._exits:     # for callers of step() alone; run() wakes on them in select()
            late = [fd for fd, x in self._exits.items() if now > x.until]
            for fd in set(select.select(list(self._exits), [], [], 0)[0] + late):
                self._reap(fd)
                dirty = True
        for e in events:
            if e.flags & EF_TRACED or e.op == "full":
                self._killed_unchecked(e)   # BPF killed it before its call ran: nothing to hold
                continue
            if e.pid in self.shimmed and e.op in ("unknown", "stall", "over_limit", "quota"):
                self.broker.caught(e.pid)   # BPF stopped it: it is resumed as anyone from now on
            if e.op == "unknown":
                also = ()
                if e.flags & EF_ORDINAL:    # its first placement: map its ordinals first
                    m = self.tracer.map_gpus(e.pid, self.unmapped_charge == "all")
                    e, also = e._replace(dev=m.host(e.dev)), m.also if self.unmapped_charge == "all" else ()
                if e.restall:
                    self._restalled(e)
                if self._measure_hold(e, also):   # a GPU never seen: its context is measured first
                    continue
                self._place(e.pid, max(e.dev, 0), e.size, e.tid, e.result, also)
                dirty = True
            elif e.op in ("stall", "over_limit"):
                box = self.by_key.get(e.addr)
                if box is not None and e.op == "over_limit" and self.over_limit == "kill":
                    # BPF killed it (stop_then_tell): nothing waits, and its exit may come in this batch
                    box.over_limits += 1
                    log.warning("container %s GPU%d: pid %d needs %s for its %s, above its limit %s: killed "
                                "before it ran", box.name, max(e.dev, 0), e.pid, format_size(e.size), e.api,
                                format_size(self.books.limit(box, max(e.dev, 0))))
                elif box is not None:
                    if e.restall:
                        self._restalled(e, box)
                    else:
                        log.info("stall %s pid %d on GPU%d: %s %s would bring it to %s (assigned %s)",
                                 box.name, e.pid, max(e.dev, 0), e.api, format_size(e.size),
                                 format_size(e.live), format_size(box.assigned.get(max(e.dev, 0), 0)))
                    self._waiter(box, max(e.dev, 0), e.pid, 0, ask=Ask(e.pid, e.tid, e.size, now, e.result,
                                                                        over_limit=e.op == "over_limit",
                                                                        reserved=bool(e.flags & EF_RESERVED)))
                dirty = True
            elif e.op == "quota":
                self._quota_hit(e)
            elif e.op == "exec":
                self._gone(e.pid)
                dirty = True
            elif e.op == "exit":
                self._exiting(e.pid, e.size, e.ts_ns, contexts=e.live, gen=e.addr)
                dirty = True
            elif e.op in ("free", "ctx_destroy"):   # room for someone, if anyone waits
                dirty = dirty or any(b.waiting for b in self.boxes.values())
            if e.api in INDIRECT and e.op in ("alloc", "graph", "unsized"):   # named if it goes over
                seen = self.calls_seen.setdefault(e.pid, {})
                seen[e.api] = seen.get(e.api, 0) + 1
        return dirty

    def _box_for(self, pid: int, keep: bool = True) -> Box | None:
        """pid's container's record, made where there is none. keep=False: a record made here is
        not kept (a shim's message from a process that has opened no GPU, issue 39 attack 1:
        each such message used to leave a record with an assignment and no process, for good)."""
        try:
            c = self.container_of(pid)
        except Exception:
            return None
        box = self.boxes.get(c.id)
        if box is None and not keep:
            meta = self.engines.lookup_sync(c) if self.engines is not None else None
            name = meta.name if meta and meta.name else self.names.get(c.cgroup, c.short)
            limit, source = self.rules.limit_for(c, name, meta.labels if meta else None)
            return Box(0, c, name, time.monotonic(), self.books.capped(name, limit), source)
        if box is None:
            if self.durable.sweep((c.id, c.cgroup)):   # a new cgroup where a gone one was decided for
                self._decided()
            meta = self.engines.lookup_sync(c) if self.engines is not None else None
            name = meta.name if meta and meta.name else self.names.get(c.cgroup, c.short)
            labels = meta.labels if meta else None
            limit, source = self.rules.limit_for(c, name, labels)
            box = Box(self._next_key, c, name, time.monotonic(), self.books.capped(name, limit), source,
                      labels=labels)
            self._next_key += 1
            self.boxes[c.id] = box
            self.by_key[box.key] = box
            log.info("container %s (%s): limit %s from %s", name, c.kind, format_size(limit), source)
            usage = self.tracer.usage()   # its other processes that already use the GPU join too
            for u in {u.pid for u in usage} - set(self.pid_box) - {pid}:
                try:
                    if self.container_of(u).id == c.id:
                        self._join(box, u, usage=usage)
                except Exception:
                    pass
        return box

    def _place(self, pid: int, dev: int, request: int, tid: int = 0, seq: int = 0, also=()):
        """also: the other GPUs it may be using (its mapping is not established: BPF charges
        its bytes there too, into the container's state on each)."""
        box = self._box_for(pid)
        if box is None:     # gone before we could place it: nothing to hold
            os.kill(pid, signal.SIGCONT) if alive(pid) else None
            return
        if self._process_quota_full(box, pid):   # `members` is bounded too (enforcer/quotas.py)
            return
        self._join(box, pid, dev, request)
        for d in sorted(set(also) & set(self.capacity) - set(box.assigned)):
            self._new_device(box, d)
        if FAULT:
            FAULT.hit("place")   # a member with an assignment in BPF, no waiter recorded yet
        self._waiter(box, dev, pid, 0, count=False,
                     ask=Ask(pid, tid or pid, request, time.monotonic(), seq, over_limit=request > self.books.limit(box, dev),
                             first=True))
        if self.books.demand(box, dev) > box.assigned[dev]:   # placed, but nothing to run on yet
            box.stalls += 1
            log.info("stall %s pid %d on GPU%d: placed with %s assigned, needs %s", box.name, pid,
                     dev, format_size(box.assigned[dev]), format_size(self.books.demand(box, dev)))

    def _join(self, box: Box, pid: int, dev: int | None = None, request: int = 0, usage=None):
        """pid is in box from now on. What it allocated before (while no enforcer admitted, or
        in calls that are not admitted) was charged to no container: adopt it. Read before the
        membership is written, so a racing free can only make this an over-count. A member
        placed again (its first context on another GPU) adopts nothing on the GPUs the box has:
        BPF charged its bytes there already."""
        charged = set(box.assigned) if self.pid_box.get(pid) is box else set()
        held = {u.dev: (u.live, max(u.contexts, 0)) for u in (usage or self.tracer.usage())
                if u.pid == pid and u.dev not in charged and (u.live or u.contexts > 0)}
        self._ensure_quota(box)
        self._t("members")[ct.c_uint(pid)] = ct.c_ulonglong(box.key)
        box.pids.add(pid)
        self.pid_box[pid] = box
        for d in sorted(set(held) | ({dev} if dev is not None else set())):
            if d not in box.assigned:
                self._new_device(box, d, request if d == dev else 0)
        for d, (nbytes, nctx) in held.items():
            b0, c0 = box.adopted.get(d, (0, 0))
            box.adopted[d] = (b0 + nbytes, c0 + nctx)
            self.write_assign(box, d)
            log.info("container %s GPU%d: pid %d already held %s in %d contexts: adopted", box.name,
                     d, pid, format_size(nbytes), nctx)

    def _new_device(self, box: Box, dev: int, request: int = 0):
        """First context of a container on a device: A_c = min(L_c, unassigned), cut to what
        keeps the device safe, 0 (it waits) where even the call it is stopped at (`request`,
        on top of what it already holds) is not (policies.assign_new)."""
        free = self.books.free(dev)
        held = self.books.held(box, dev)
        box.assigned[dev] = policies.assign_new(self.books.limit(box, dev), free, self.books.claims(dev, but=box),
                                                self.capacity.get(dev, 0), held, held + request,
                                                box.container.id)
        self._ensure_state(box, dev)
        self.write_assign(box, dev)
        log.info("container %s GPU%d: assigned %s (limit %s)", box.name, dev,
                 format_size(box.assigned[dev]), format_size(self.books.limit(box, dev)))

    def _waiter(self, box: Box, dev: int, pid: int, unreserved: int, count: bool = True,
                ask: Ask | None = None):
        """A shim request (unreserved bytes) or a stopped call (ask) waits on dev."""
        self.broker.revoke(box, dev)   # credit of the container's shim processes: for the waiter
        w = box.waiting.get(dev)
        if w is None:
            now = time.monotonic()
            w = box.waiting[dev] = Wait(now, set(), freed_at=now, held_was=self.books.taken(box, dev))
            box.stalls += count
        if pid in self.shimmed:
            w.unreserved += unreserved
        if ask is not None:   # a re-stall replaces its thread's ask (the same call)
            box.going.get(dev, {}).pop(ask.tid, None)
            old = w.asks.get(ask.tid)
            w.asks[ask.tid] = ask if old is None else Ask(ask.pid, ask.tid, ask.size, old.since, ask.seq, ask.over_limit,
                                                          reserved=ask.reserved)
        w.pids.add(pid)
        if pid in self.shimmed:
            return w
        if isinstance(self.stopper, SignalStopper):
            if ask is not None and self.holder is not None:
                self.holder.hold(pid, ask.tid)   # only that thread waits, where ptrace allows
            return w
        # freezer mode: hold the whole container in its cgroup, then drop the signal stop,
        # so that no SIGCONT from inside the container can undo the stall
        try:
            self.stopper.stall(Target(tuple(box.pids), box.container.cgroup))
            for p in box.pids:
                os.kill(p, signal.SIGCONT) if alive(p) else None
        except Exception as e:
            log.warning("container %s: freezer failed (%s); it stays signal-stopped", box.name, e)
        return w

    def _killed_unchecked(self, e):
        """BPF killed a thread at a call no stop could hold (bpf stop_then_tell, issue 33): one
        traced by another process (which sees a SIGSTOP first and may drop it: attack 2), or one
        the full `threads` map leaves no entry to check its call with."""
        box = self.pid_box.get(e.pid)
        who = f"pid {e.pid} thread {e.tid}" + (f" of {box.name}" if box else "")
        if e.op == "full":
            log.warning("%s: the BPF threads map is full, so its %s cannot be tracked: killed before it "
                        "ran (more containers at their thread quotas than the maps hold; see --max-threads)",
                        who, e.api)
        else:
            log.warning("%s: traced by pid %d, not convgpu, which can swallow a stop: %s before its %s ran",
                        who, e.result, "stopped at entry, it ran on without a grant; killed" if e.restall
                        else "killed", e.api)

    def _restalled(self, e, box: Box | None = None):
        if box is not None:
            box.restalls += 1
        log.warning("pid %d%s resumed without a grant (SIGCONT from outside?): stopped again "
                    "before its %s ran", e.pid, f" of {box.name}" if box else "", e.api)

    def _gone(self, pid: int):
        self.contradicted.pop(pid, None)
        self.calls_seen.pop(pid, None)
        if pid in self.shimmed:
            self.broker.shim_gone(pid)
        box = self.pid_box.pop(pid, None)
        if box is None:
            return
        frozen = bool(box.waiting) and not isinstance(self.stopper, SignalStopper)   # a wait froze it whole
        box.pids.discard(pid)
        box.placed.pop(pid, None)
        box.settling.discard(pid)
        settled = False
        if self.holder is not None:
            self.holder.forget(pid)
        for going in box.going.values():
            for t in [t for t, a in going.items() if a.pid == pid]:
                del going[t]
        for dev, w in list(box.waiting.items()):
            w.pids.discard(pid)
            w.asks = {t: a for t, a in w.asks.items() if a.pid != pid}
            if not w.pids:
                del box.waiting[dev]
                settled = True
        if settled and box.pids and not box.waiting and not isinstance(self.stopper, SignalStopper):
            self._thaw(box)   # its last wait went with the process: the others run again
        if not box.pids:     # the container's last process: its assignment returns to the pool
            for dev in box.assigned:
                for name in ("assign", "cgstate"):
                    t = self._t(name)
                    try:
                        del t[t.Key(container=box.key, dev=dev)]
                    except KeyError:
                        pass
            self._drop_quota(box)
            del self.boxes[box.container.id]
            del self.by_key[box.key]
            self.history.ended(box.container.id)   # its run goes to the job history
            log.info("container %s exited: %s back to the pool", box.name,
                     format_size(sum(box.assigned.values())))
            if not isinstance(self.stopper, SignalStopper):
                self._thaw_emptied(box, frozen)

    def _thaw_emptied(self, box: Box, frozen: bool):
        """Freezer: the container's last CUDA process left (killed while it waited, say), and the
        box goes. Its cgroup is thawed with it: dropped frozen, the next process to join it froze
        with nobody to thaw it (issue 33, attack 6), and so did what else ran there."""
        try:   # whether it waited, frozen, not cgroup.events: an exiting task may show it unfrozen
            self.stopper.resume(Target((), box.container.cgroup))   # idempotent
            if frozen:
                log.info("container %s: its last process left while its cgroup %s was frozen: thawed",
                         box.name, box.container.cgroup)
        except Exception as e:   # StallError, or an OSError reading its state: one line, the loop goes on
            log.warning("container %s: its last process left, and its cgroup %s could not be thawed (%s): "
                        "thaw it by hand", box.name, box.container.cgroup, e)

    def _exiting(self, pid: int, tracked: int = 0, at: int = 0, contexts: int = 0, gen: int = 0):
        """The last thread of pid is in exit: it leaves its container now, but the driver frees
        its device memory only when the kernel closes its files, after the event (do_exit: the
        tracepoint, exit_mm, exit_files), 55 ms later on the H100. Until its pidfd becomes
        readable (exit_notify) those bytes are held against the card's physical room (see
        _room), so a waiter resumes at once where the card has room for both, and only
        once they are back where it has not. tracked: its live bytes and context charges;
        at: the exit tracepoint's time (CLOCK_MONOTONIC ns), for the timeline; contexts: how
        many it had (measured by NVML: what NVML said; else the estimate each); gen: its BPF
        generation, under which BPF left what it moved to its container's `tearing` (until
        the pidfd fires, the container holds it: a sibling or a resumed waiter cannot take
        its place while the driver still holds it, issue 23 part 2)."""
        t = time.monotonic_ns()
        box = self.pid_box.get(pid)
        devs = sorted(box.assigned) if box else []
        # on every device of its container: the event gives one total (where, BPF has forgotten)
        measured = [self.excess[(pid, d)] for d in devs if (pid, d) in self.excess]
        unmeasured = max(0, contexts - sum(n for _, n in measured))
        held = (tracked + sum(over for over, _ in measured)
                + unmeasured * max((self._ctx(d) for d in devs), default=0))
        log.debug("pid %d exiting, %d bytes held (kernel t=%d) (t=%d)", pid, held, at, t)   # bench.sched.resume
        charge = self._torn_at_exit(gen)
        if box is not None and len(devs) == 1:   # what it held at its exit: a floor for its job's peak
            self.history.exited(box.container.id, pid, {devs[0]: held})
        self._gone(pid)
        x = Exit(pid, time.monotonic() + EXIT_WAIT, {d: held for d in devs}, box, charge)
        if not held or not devs:
            return self._torn(x)
        try:
            fd = os.pidfd_open(pid)
        except OSError:     # reaped already
            return self._torn(x)
        self._exits[fd] = x
        if select.select([fd], [], [], 0)[0]:
            self._reap(fd)
            return
        self.sel.register(fd, selectors.EVENT_READ, lambda _mask, fd=fd: (self._reap(fd), self._changed()))

    def _reap(self, fd: int):
        x = self._exits.pop(fd)
        try:
            self.sel.unregister(fd)
        except KeyError:
            pass
        os.close(fd)
        self._torn(x)
        log.debug("pid %d gone (t=%d)", x.pid, time.monotonic_ns())

    def _torn_at_exit(self, gen: int) -> dict[int, int]:
        """What BPF moved to the exited process's container's `tearing`, per device (read once)."""
        if not gen or not self.tracer.kernel:
            return {}
        t = self._t("gone")
        k = ct.c_ulonglong(gen)
        try:
            g = t[k]
            del t[k]
        except KeyError:
            return {}
        return {d: c for d, c in enumerate(g.charge) if c}

    def _torn(self, x: Exit):
        """The driver has freed an exited process's memory: its container holds it no more."""
        box = x.box
        if box is None or not x.charge or self.by_key.get(box.key) is not box:
            return
        for d, c in x.charge.items():
            box.torn[d] = box.torn.get(d, 0) + c
            if d in box.assigned:
                self.write_assign(box, d)

    def _unprobed(self, pid: int, lib, reason: str) -> str:
        """probes/discovery.py asks: pid opened a driver file that cannot be probed. Its calls
        would go unchecked, so by default it stays stopped (fail closed; `status` says why).
        Discovery logs it, once per container and reason (a container can open a bad copy in a loop)."""
        return self.unprobed
