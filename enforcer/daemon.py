"""`convgpu enforce`: per-container GPU-memory limits, enforced by stalling (ConVGPU III-D/E).

BPF admits or stops each call before it runs (bpf/admit.bpf.c); this loop places new processes
in containers, assigns memory, and resumes waiters as the policy grants memory. Every decision
is one log line. The BPF side fails open when the heartbeat stops.

The Enforcer is built from parts, each an object handed what it uses (docs/DESIGN.md, "The
enforcer's parts"). Its constructor builds them in order and is the wiring diagram; _take routes
each probe event to the part that hears it; the rest is the life cycle and the loop."""
import logging
import os
import random
import select
import selectors
import signal
import time

from . import attribution, backstop, ctxest, policies
from .serving import server, shimprobes
from .failsafe import takeover, watchdog
from .accounting import Accountant
from .actuator import Actuator, Holds
from .admission import Admission
from .bpfmaps import BpfMaps, cgstate_reader, held_seq
from .books import Books, Box
from .decisions import Decider
from .exits import Exits
from .failsafe.adopt import Adopter
from .failsafe.heartbeat import Heartbeat
from .failsafe.stall import SignalStopper
from .failsafe.watchdog import write_state
from .history import HistoryFile, Recorder, from_books
from .overhead import ContextCharge, read_gpus
from .placement import Placement
from .quotas import MapQuota, Quotas
from .reporting import Reporter
from .runtime import Runtime, share_of
from .serving.broker import ShimBroker
from .serving.credit import ShimCredit
from .serving.peers import SHIM_CAPS, raise_nofile
from .tenants import durable
from .swap.client import Agent, checkpoint_api
from .swap.swapper import Settings as SwapSettings, Swapper
from .tenants.cgroupfs import cgroup_layout, procs_in
from .tenants.containers import container_of_pid
from .tenants.limits import LimitRules
from ..probes.events import EF_TRACED
from ..probes.nvml import Cached
from ..probes.table import INDIRECT

log = logging.getLogger(__name__)
HEARTBEAT_EVERY = 0.25   # s; BPF stops admitting (fails open) after 2 s without one
LOOP_LATE = 1.0          # s between two passes of the loop that gets a warning
LOOP_HUNG = 30.0         # s without a pass: the heartbeat stops (enforcer/failsafe/heartbeat.py)
MEASURE_EVERY = 1.0      # s; the measured context overhead from NVML's latest sample
HELD_DEFER = 0.005       # s the state file may wait for events that woke the enforcer meanwhile


class Enforcer:
    """One enforcer: its parts, built in the order they need each other, and its life cycle."""

    def __init__(self, tracer, policy: str, capacity: dict[int, int], rules: LimitRules,
                 stopper=None, over_limit: str = "stall", ctx_overhead: int | None = None,
                 max_wait: float = policies.MAX_WAIT, seed: int | None = None, engines=None,
                 container_of=container_of_pid, run_dir: str = "/run/convgpu", nvml=None,
                 reload=None, physical: dict[int, int] | None = None, unprobed: str = "stall",
                 state_dir: str | None = None, quota: MapQuota | None = None,
                 unmapped_charge: str = "all", handover: float = 0.0, swap: SwapSettings | None = None):
        self.tracer, self.rules, self.container_of = tracer, rules, container_of
        self.stopper = stopper = stopper or SignalStopper()
        self.unprobed = unprobed   # a process that opened a driver file we cannot probe: stall|kill|allow
        self.run_dir, self.started = run_dir, time.time()
        self.handover = handover   # s a successor may take to take over what we hold at a SIGTERM
        self.state_file = os.path.join(run_dir, f"held-{os.getpid()}.json")
        self.control_path = os.path.join(run_dir, "control.sock")
        self.pin_dir = takeover.pin_dir_for(run_dir)
        self.owner = random.SystemRandom().randrange(1, 1 << 31)   # control.owner: who admits
        # the card's memory convgpu may count on (NVML's total less --reserve); unknown, the
        # capacity: then an exit's memory returns to the pool only once the driver freed it
        physical = {d: max(c, (physical or {}).get(d, c)) for d, c in capacity.items()}
        gpus = read_gpus(nvml)   # NVML's GPUs, read once (never from the loop)
        if gpus and hasattr(tracer, "gpumap"):
            tracer.gpumap.gpus = list(gpus.values())   # ordinals to host GPUs (probes/gpumap.py)
        self.sel = selectors.DefaultSelector()
        self.watchdog = self.lifeline = None   # the watchdog's process, and the pipe it watches (start)

        # ---- the parts, each handed what it uses (docs/DESIGN.md maps them). Events in: the probes'
        # through _take to Placement, Exits, Quotas and the broker; the shim's socket to the broker;
        # NVML's samples to ContextCharge and the backstop. The books are changed by Placement and
        # Exits (who is where, who waits), the decider (assignments), the actuator (a wait ends),
        # Runtime (limits), ContextCharge (context charges), ShimCredit and the Adopter (at start).
        # BPF's maps are written through BpfMaps alone.
        self.holds = Holds()   # a stop holds a thread (ptrace, from start()) or its process
        self.charges = ctxest.Charges(ctxest.devices(capacity, gpus, getattr(nvml, "driver", "") or ""),
                                      ctx_overhead, ctxest.MeasuredStore(state_dir))
        self.books = Books(capacity, physical, cgstate_reader(tracer), self.charges.ctx, share_of(rules, gpus),
                           whole=self.holds.whole, freezer=not isinstance(stopper, SignalStopper))
        self.maps = BpfMaps(tracer, self.books.limit, self.charges.ctx, self.books.beyond)   # the one writer of BPF's maps
        # swap (enforcer/swap/): its agent, the child that makes the driver's checkpoint calls, comes at start
        self.swapper = Swapper(self.books, self.maps, tracer, None, swap or SwapSettings(), self._process_holds,
                               self.holds.whole, lambda: self.charge.sampler,
                               lambda d: gpus[d].total if d in gpus else physical.get(d, 0), self._changed,
                               lambda pid: self.actuator.kill(pid),
                               os.path.join(state_dir, "swap.json") if state_dir else None)
        self.actuator = Actuator(stopper, self.holds, self.maps, self.books.shimmed, self.swapper.resume)
        self.decider = Decider(self.books, self.actuator, policy, random.Random(seed), max_wait, over_limit,
                               process_holds=self._process_holds, holder=self.holds.current, swap=self.swapper)
        over = lambda: self.decider.over_limit   # noqa: E731 (a reload may change it)
        self.admission = Admission(self.maps, self.books.waiters, self.charges.newcomer_charge, over,
                                   quota or MapQuota(), self.owner)
        self.charge = ContextCharge(tracer, nvml, gpus, self.charges, self.books, self.maps.write_assign,
                                    self.admission)
        self.quotas = Quotas(self.maps, self.books, self.admission.quota, over)
        self.credit = ShimCredit(self.books)
        # run-time limits and names, kept in the state dir across restarts (tenants/durable.py);
        # read (and the directory locked) at start, before the first admission
        self.durable = durable.Store(state_dir)
        self.runtime = Runtime(rules, self.durable, self.books, self.decider, self.credit.revoke,
                               self.maps.write_assign, self.admission.write, reload, gpus, self.charges.estimate)
        self.history = Recorder(HistoryFile(state_dir) if state_dir else None)   # each job's runs (history/)
        self.placement = Placement(tracer, self.books, self.maps, self.actuator, self.credit.revoke, self.quotas,
                                   self.runtime, self.history, self.charge.hold_newcomer, container_of, engines,
                                   unmapped_charge, over)
        self.exits = Exits(tracer, self.books, self.maps, self.charges, self.history, self._gone, self.sel,
                           self._changed)
        self.broker = ShimBroker(tracer, self.books, self.credit, self.placement, self.maps, self.decider.schedule,
                                 self.charges, self._take, unmapped_charge)
        # the driver's own count as the last word: over a limit however obtained, by whoever can be
        # shown to hold it (backstop.py, attribution.py)
        proof = attribution.Proof({d: g.minor for d, g in gpus.items()})
        self.backstop = backstop.Backstop(self.books, stopper, attribution.Attribution(proof), self.placement.place_stray,
                                          self.actuator.kill, self.books.waits_whole, self._own_pids,
                                          self.charge.calls_of, self.charge.accounted, over, container_of,
                                          lambda cg: procs_in(cg, cgroup_layout()), self._save_now,
                                          self.maps.write_assign)
        self.backstop.off = self.charge.backstop_off(capacity)
        # what `convgpu trace` shows while we run (it asks us rather than probing twice)
        self.acct = Accountant(nvml=Cached(list(gpus.values()), lambda: self.charge.sampler, nvml.driver)
                               if nvml is not None and nvml.ok else None,   # never NVML itself from the loop
                               ctx_overhead=None if nvml is not None and nvml.ok else ctx_overhead,
                               engines=engines, container_of_pid=container_of)
        self.reporter = Reporter(tracer, self.books, self.decider, self.charge, self.backstop, self.broker,
                                 self.quotas, self.holds, self.runtime, self.history, self.admission, self.acct,
                                 stopper, self.state_file, lambda: self.watchdog.pid if self.watchdog else None,
                                 unprobed, unmapped_charge, self.started, handover, self.swapper)
        self.adopter = Adopter(tracer, self.maps, self.books, self.runtime, self.charges.ctx, container_of,
                               run_dir, self.state_file, self.pin_dir, self.owner)
        self.heartbeat = Heartbeat(self.maps.beat, HEARTBEAT_EVERY, LOOP_HUNG)

        self.servers: list[server.Server] = []
        self.metrics = None   # enforcer.metrics.MetricsServer, set by the CLI
        self._measured = self._published = 0.0
        self._reload_asked = False
        self._held_due = 0.0               # when the state file became due (0: written)

    # ---- readers the parts are handed ----
    def _process_holds(self, box: Box, dev: int) -> dict[int, tuple[int, int]]:
        """pid -> (what it holds on dev, of that its contexts), from BPF's per-process usage
        and NVML's measured contexts (the decider reads it only when there are several
        stopped units to order)."""
        out, excess = {}, self.charges.excess
        for u in self.tracer.usage():
            if u.dev != dev or u.pid not in box.pids:
                continue
            ctx = excess[(u.pid, dev)][0] if (u.pid, dev) in excess else max(u.contexts, 0) * self.charges.ctx(dev)
            out[u.pid] = (u.live + ctx, ctx)
        return out

    def _save_now(self):
        """The watchdog's state file, now: the backstop writes whom it stops before it stops them
        (a death right after the stop resumed nobody before: issue 47)."""
        self._held_due = 0.0
        self.reporter.save_held()

    def _own_pids(self) -> set[int]:
        return ({os.getpid(), self.admission.exempt, self.maps.measuring}
                | ({self.watchdog.pid} if self.watchdog else set())
                | ({a} if self.swapper.agent and (a := self.swapper.agent.pid()) else set()))

    # ---- events in: each to the part that hears it ----
    def _take(self, events, now: float) -> bool:
        """The probes' events and the exits whose pidfd fired into the books; True if that
        changed what the decider may decide."""
        dirty = self.exits.reap_due(now)
        for e in events:
            if e.flags & EF_TRACED or e.op == "full":
                self.placement.killed_unchecked(e)   # BPF killed it before its call ran: nothing to hold
                continue
            if e.pid in self.books.shimmed and e.op in ("unknown", "stall", "over_limit", "quota"):
                self.broker.caught(e.pid)   # BPF stopped it: it is resumed as anyone from now on
            if e.op == "unknown":
                dirty |= self.placement.first_call(e)
            elif e.op in ("stall", "over_limit"):
                self.placement.stalled(e, now)
                if e.pid in self.books.swapped_pids:   # its next call, stopped: it wants its memory back
                    self.swapper.want(e.pid, f"its {e.api}")
                dirty = True
            elif e.op == "touch":   # a swapped process's next call, blocked in the driver (bpf/swap.bpf.c)
                self.swapper.want(e.pid, "its next driver call")
            elif e.op == "quota":
                self.quotas.hit(e)
            elif e.op == "exec":
                self._gone(e.pid)
                dirty = True
            elif e.op == "exit":
                self.exits.exiting(e.pid, e.size, e.ts_ns, contexts=e.live, gen=e.addr)   # then _gone
                dirty = True
            elif e.op in ("free", "ctx_destroy"):   # room for someone, if anyone waits
                dirty = dirty or any(b.waiting for b in self.books.boxes.values())
            if e.api in INDIRECT and e.op in ("alloc", "graph", "unsized"):   # named if it goes over
                self.charge.saw_call(e.pid, e.api)
        return dirty

    def _gone(self, pid: int):
        """A process left (an exit, an exec): heard by ContextCharge, the swapper, the shim broker
        and Placement."""
        self.charge.forget(pid)
        self.swapper.gone(pid)
        if pid in self.books.shimmed:
            self.broker.shim_gone(pid)
        self.placement.gone(pid)

    def status(self) -> dict:
        return self.reporter.status()

    def start(self) -> "Enforcer":
        from .serving.control import ControlHandler, answers
        os.makedirs(self.run_dir, mode=0o755, exist_ok=True)
        # the control socket first: a second enforcer on the same run dir fails here, before
        # its probes could stall anything
        if answers(self.control_path):
            from ..errors import ConfigError
            raise ConfigError(f"an enforcer already runs on {self.control_path}",
                              "stop it first, or give this one another --run-dir")
        self.durable.open()   # before anything is admitted or adopted: every limit as it was decided
        if self.durable.error:
            log.error("decisions unreadable: %s; kept as it is, and every container is held (admitted "
                      "nothing more, never killed) until it is repaired or moved aside and `convgpu "
                      "reload` reads it", self.durable.error)
        self.runtime.decided()
        self.runtime.warn_small_limits()   # a limit no context fits in: said at once (issue 52)
        raise_nofile()   # a connection is an fd: the caps (serving/peers.py) stay below the limit
        self.servers.append(server.Server(self.control_path, ControlHandler(self.reporter, self.runtime, self.swapper), 0o600,
                                          root_only=True, sel=self.sel))
        try:
            from .serving.shim import ShimHandler
        except ImportError:
            ShimHandler = None
        if ShimHandler is not None:   # any process may ask; the kernel says who it is (peers.py)
            self.servers.append(server.Server(os.path.join(self.run_dir, "shim", "shim.sock"),
                                              ShimHandler(self.broker), 0o666, root_only=False, sel=self.sel,
                                              caps=SHIM_CAPS, group_of=self.placement.group_of))
        self.tracer.selftest_exempt = self.admission.exempting
        self.tracer.recheck = True
        self.tracer.selftest_later = True   # admission on first: it only reports (Tracer.poll)
        if self.tracer.kernel:
            prev = self.adopter.load_over_pins()
            self.tracer.shims = shimprobes.libraries(self.run_dir)   # never taken for drivers
            for path in self.tracer.shims or (None,):   # only calls from inside them wait in the shim
                shimprobes.attach(self.tracer.b, path)
        else:
            self.tracer.start()
            prev = []
        self.charge.start_sampler(backstop.SAMPLE_EVERY)   # once the probes' maps exist
        self._wake_fd = self.tracer.fileno()
        self.sel.register(self._wake_fd, selectors.EVENT_READ, lambda _mask: None)
        reader = getattr(getattr(self.tracer, "discovery", None), "reader", None)
        if reader is not None:      # a driver file read, a process looked at: settle it at once
            self.sel.register(reader.fd, selectors.EVENT_READ, lambda _mask: reader.drain())
        signal.signal(signal.SIGHUP, self._on_hup)
        self.adopter.adopt(prev)
        self.runtime.say_unmatched("at start")   # a limit written otherwise than a name is seen
        if self.tracer.kernel:   # what a stack limit costs, before a call is admitted
            self.maps.write_resident(self.charge.resident())
        self.charge.plan()   # a GPU model never seen: its newcomers wait for a measured context
        write_state(self.state_file, [], [], handover=self.handover)
        if not self.tracer.kernel:   # shims wait in their threads: nothing to undo if we die
            self.swapper.off = "no probes (--no-probes): a swapped process's next call would go unheard"
            log.warning("no probes (--no-probes): only processes under the preload shim are limited")
            self.admission.write(True)
            log.info("enforcing: policy %s, capacity %s (shim only)", self.decider.policy, self.reporter.capacity_text())
            return self
        # The watchdog (enforcer/failsafe/watchdog.py) learns of our death from a pipe; it turns
        # admission and discovery off at once and resumes whoever we held
        self.fds = takeover.FdSender()
        zero, held = self.tracer.discovery.fail_safe_fds()
        self.watchdog, self.lifeline = watchdog.spawn(os.getpid(), self.state_file,
                                                      [self.maps.table("control").map_fd, *zero],
                                                      held, self.fds.theirs, self.pin_dir)
        self.fds.theirs.close()
        self.fds.send(takeover.probe_fds(self.tracer.b))
        self.tracer.on_release = self.fds.drop
        self.reporter.save_held()
        self.admission.write(True)
        # probes/discovery.py asks of a driver file that cannot be probed: its calls would go
        # unchecked, so by default its process stays stopped (fail closed; `status` says why)
        self.tracer.discovery.on_unprobed = lambda pid, lib, reason: self.unprobed   # stall|kill|allow
        if isinstance(self.stopper, SignalStopper):   # the freezer holds containers whole
            self.holds.start(held_seq(self.maps.table("held")))
        self.tracer.enable_discovery(own_watchdog=False)
        self.heartbeat.loop_ran()
        self.heartbeat.start()
        takeover.retire(prev)   # our probes own admission now: the old ones may detach
        if prev:
            self._take_over_holds(prev)
        self._start_swap()
        log.info("enforcing: policy %s, capacity %s", self.decider.policy, self.reporter.capacity_text())
        return self

    def _start_swap(self):
        """The checkpoint agent (a child: never the driver in this process), on the host's own
        driver; then what an enforcer before us left swapped is taken back (Swapper.load)."""
        driver = self.charge.host_driver()
        self.swapper.off = checkpoint_api(driver) if driver else "no host driver to make the checkpoint calls with"
        if self.swapper.off:   # read in the file, as the probes read it: no process
            log.info("swap: off (%s)", self.swapper.off)
            return
        log.info("swap: the checkpoint calls of %s; %s", driver, f"idle holders go out after {self.swapper.settings.idle_s:g} s"
                 if self.swapper.settings.idle_s else "by hand only (`convgpu swap out`; --swap-idle for a policy)")
        self.swapper.agent = Agent(driver)   # its child starts at the first swap: none sits idle meanwhile
        self.reporter.release = self.swapper.release_argv()   # the watchdog's, if we die
        self.sel.register(self.swapper.agent.fileno(), selectors.EVENT_READ, lambda _mask: None)
        self.swapper.load()

    def _take_over_holds(self, prev: list[dict]):
        """The calls the enforcer before us left stopped are our waits now: all it held where it
        handed over (--handover), else any its watchdog's resume missed (a thread its ptrace hold
        let go at its death and that stopped again). Each is held by its thread, as a stall of
        ours is (ThreadHolder.hold: the process seized, its group stop ended, every thread that
        BPF's `held` map lists at a call kept, the others run on). Held whole, as they were, a
        container whose limit cannot take every thread's call at once (two 518 MiB contexts
        and six 256 MiB blocks under 2,304 MiB on the H100) had a waiter in each process: the
        threads BPF had admitted were stopped with them, never returned nor freed, and no job
        finished (the GPU torture, 2026-12-06). Where it handed over, what else it held runs
        again (the backstop stops it again while it is over); its stops at a driver's open are
        its watchdog's to resume."""
        handed = any(st.get("handing_over") for st in prev)
        events = self.adopter.stalled(handed)
        pids = {e.pid for e in events}
        self._take(events, time.monotonic())   # each a stall: held as ours are (Actuator.hold)
        ours = {self.stopper.root.rstrip("/") + cg for b in self.books.boxes.values() if b.waiting for cg in b.cgroups} \
            if not isinstance(self.stopper, SignalStopper) else set()
        for st in prev if handed else ():
            self.actuator.signal(set(st.get("pids", [])) - pids, signal.SIGCONT)
            watchdog.thaw(set(st.get("cgroups", [])) - ours)
        if events:
            log.info("took over %d calls held by the enforcer before (%s)", len(events),
                     ", ".join(f"pid {e.pid} thread {e.tid}" for e in events))
            self._changed()

    def close(self, hand_over: bool = False):
        """Nothing stays stopped: every waiter is resumed, admission is turned off. hand_over
        (a SIGTERM with --handover): what we hold stays held for our successor (_hand_over)."""
        if hand_over and self.handover > 0 and self.watchdog is not None:
            return self._hand_over()
        self.heartbeat.stop()   # before admission goes off: it would write it back on
        if self.tracer.b is not None:
            self.admission.write(False)
        for box in self.books.boxes.values():
            for dev in list(box.waiting):
                self.actuator.resume(box, dev, "enforcer stopping")
        self.holds.close()   # after the releases above: it lets go of every thread
        if self.tracer.kernel and self.tracer.b is not None:   # BPF stops only with probes
            self.actuator.resume_unplaced()
        for srv in self.servers:
            srv.close()
        self.servers.clear()
        if self.metrics is not None:
            self.metrics.close()
        self.charge.close()   # its sampler; a measurement's child goes (newcomers it held: resume_unplaced)
        self.swapper.close()  # what is out: brought back by a release agent as it fits
        self.history.close()   # runs still going are kept as cut short
        self.durable.close()
        if self.watchdog is not None:   # nothing is held now: it has nothing left to do
            # first, while our probes hold every event: its duplicates then go with it at once, and
            # ours detach below at once (links) or in a child (perf events, seconds to minutes for
            # hundreds: a stop, or a restart by systemd, need not wait). Discovery is off before, so
            # nothing is stopped at its open once the watchdog is gone
            self.tracer.discovery.disable()
            self.watchdog.kill()
            self.watchdog.wait()
            # the lifeline sits just under the descriptor limit (watchdog.spawn): left open, every
            # enforcer closed in one process took one of those 17 places until spawn() failed with
            # EMFILE (the 18th in-process enforcer of the test suite)
            os.close(self.lifeline)
            self.watchdog = None
            try:
                os.unlink(self.state_file)
            except OSError:
                pass
            takeover.clear(self.pin_dir)   # no probes left to keep the maps exact
        self.tracer.close(background=True)

    def _hand_over(self):
        """A restart (systemctl restart, a DaemonSet rollout) is not a release: every stopped call
        stays stopped, and admission on, for up to --handover s while our watchdog waits for the
        successor that takes them over (failsafe/watchdog.py hand_over). Before, each restart
        resumed every waiter and let it past its limit (6 GiB on a 4 GiB claim). A thread held
        alone by ptrace is first stopped whole: the kernel lets a tracee run at its tracer's
        exit, but leaves a process in a group stop stopped."""
        self.heartbeat.stop()   # the watchdog beats from our exit on
        held = {a.pid for b in self.books.boxes.values() for w in b.waiting.values() for a in w.asks.values()}
        self.actuator.signal(held, signal.SIGSTOP)
        self.reporter.save_held()
        for srv in self.servers:
            srv.close()
        self.servers.clear()
        if self.metrics is not None:
            self.metrics.close()
        self.charge.close()
        self.swapper.close(hand_over=True)   # what is out stays out: the successor takes it (swap.json)
        self.history.close()
        self.durable.close()
        log.info("handing over: %d processes stay stopped at their calls, admission on, for up to %.0f s "
                 "until the next enforcer takes them over", len(held), self.handover)
        os.close(self.lifeline)   # the watchdog hands over from now; the probes and pins stay

    def step(self):
        now = time.monotonic()
        held = self.heartbeat.loop_ran()
        if held > LOOP_LATE:   # said, so a log explains the wait (and any unchecked calls)
            log.warning("the loop was held %.2f s: stalls, grants and resumes waited meanwhile%s", held,
                        "" if held < LOOP_HUNG else "; its heartbeat lapsed, and BPF admitted every "
                        "call unchecked from 2 s after that")
        if self._reload_asked:
            self._reload_asked = False
            self.runtime.reload()
        events = self.tracer.poll()
        self.acct.feed(events)
        dirty = self._take(events, now)
        if self.quotas.held:
            self.quotas.resume_due()
        if dirty:   # a resume first: the periodic work below can wait for it
            self._changed()
        if self.charge.measuring():
            released = self.charge.measured(now)
            if released is not None:   # its newcomers, placed asking for the figure measured
                for e, also, size in released:
                    self.placement.place(e.pid, max(e.dev, 0), size, e.tid, e.result, also)
                self._changed()
            self.charge.measure_next()
        sampler = self.charge.sampler
        if sampler is not None and sampler.seq != self.backstop.seq:   # the driver's count
            dirty |= self.backstop.step(sampler.raw, sampler.seq, now, sampler.compute, sampler.used)
        if now - self._measured >= MEASURE_EVERY:
            self._measured = now
            # also a catch-all: frees seen only by a retiring predecessor's probes wake nobody,
            # and exits it read the event of and never acted on
            if (self.exits.sweep(now) | self.charge.measure_overhead()
                    or any(b.waiting for b in self.books.boxes.values())):
                self._changed()
                dirty = True
            if self.tracer.kernel:
                self.fds.send(takeover.probe_fds(self.tracer.b))   # libraries attached since
            self.history.sample(from_books(self.books, self.tracer.usage(), self.charges.excess, self.charges.ctx,
                                           self.runtime.names, self.rules, now, time.time()))
        self.swapper.step(now)   # the agent's answers, idleness, eager swap-ins
        self.heartbeat.beat_if_due()   # after a resume: it can wait
        self._save_held_unless_woken()
        self.runtime.sweep(now)
        if self.metrics is not None and (dirty or now - self._published >= 1.0):
            self._published = now
            self.metrics.publish(self.reporter.status(), self.tracer.usage(), self.charges.excess)
        return events

    def _changed(self):
        self.decider.schedule()
        # the waiters count: frees wake us (and go out, if quiet) only while someone waits,
        # so a free that came before BPF knew of its first waiter sent no event: look again
        if self.admission.write(True) == 0 and self.admission.told:
            self.decider.schedule()
        self._held_due = self._held_due or time.monotonic()

    def _save_held_unless_woken(self):
        """The state file (what the watchdog resumes if we die) is written at the end of the
        step, but after the events that woke us meanwhile: an exit or free right behind a stall
        then waits for no file write (the write: 0.1-0.5 ms). At most HELD_DEFER late."""
        if not self._held_due:
            return
        if time.monotonic() - self._held_due < HELD_DEFER and select.select([self._wake_fd], [], [], 0)[0]:
            return
        self._held_due = 0.0
        self.reporter.save_held()

    def run(self, duration: float = 0.0, tick: float = 0.05, on_step=None):
        """Sleeps in select() on the ring buffer (a stall or, while someone waits, a free or
        exit wakes it at once) and the sockets; at least every `tick` for the heartbeat."""
        end = time.monotonic() + duration if duration else None
        while end is None or time.monotonic() < end:
            events = self.step()
            if on_step:
                on_step(events)
            server.serve(self.sel, tick, self.servers)

    def _on_hup(self, *_):
        self._reload_asked = True   # handled in the loop, never inside a signal handler
