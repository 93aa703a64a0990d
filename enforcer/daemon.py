"""`convgpu enforce`: per-container GPU-memory limits, enforced by stalling (ConVGPU III-D/E).

BPF admits or stops each call before it runs (bpf/convgpu.bpf.c, "enforce"); this loop
places new processes in containers, assigns memory, and resumes waiters as the policy grants
memory. Every decision is one log line. The BPF side fails open when the heartbeat stops.

The Enforcer has its books (books.py: plain data and the sums over them) and its decider
(decisions.py, over the pure policies.py and within.py), which it passes the books and acts
for. Its own methods follow the data's way, one module each: events in (enforcer/events.py:
placement, stalls, exits), actions out (actions.py: BPF maps, resumes), reporting
(reporting.py: status, snapshot, state file); beside them the context overhead (overhead.py),
run-time changes (runtime.py) and the take-over from a previous enforcer (adopt.py). This
module holds its life cycle, the loop, and the readers and actions the books and the decider
are given."""
import logging
import os
import random
import select
import selectors
import signal
import threading
import time

from . import backstop, ctxest, policies
from .serving import server, shimprobes
from .failsafe import takeover, watchdog
from .accounting import Accountant
from .actions import VIEW_GRACE, Actions, alive, held_seq
from .failsafe.adopt import Adopt
from .books import Books, Box
from .serving.broker import ShimBroker
from .serving.peers import SHIM_CAPS, raise_nofile
from .tenants import durable
from .tenants.containers import container_of_pid
from .decisions import Decider
from .events import Events
from .failsafe.heartbeat import Heartbeat
from .tenants.limits import LimitRules
from .overhead import ContextOverhead
from .quotas import MapQuota, Quotas
from .reporting import Reporting
from .runtime import RuntimeChanges
from .failsafe.stall import SignalStopper
from .failsafe.threadhold import ThreadHolder, _tids
from .failsafe.watchdog import write_state
from .history import HistoryFile, Recorder, from_books
from ..probes.nvml import Cached

log = logging.getLogger(__name__)
HEARTBEAT_EVERY = 0.25   # s; BPF stops admitting (fails open) after 2 s without one
LOOP_LATE = 1.0          # s between two passes of the loop that gets a warning
LOOP_HUNG = 30.0         # s without a pass: the heartbeat stops (enforcer/failsafe/heartbeat.py)
MEASURE_EVERY = 1.0      # s; the measured context overhead from NVML's latest sample
HELD_DEFER = 0.005       # s the state file may wait for events that woke the enforcer meanwhile


class Enforcer(Events, Actions, ContextOverhead, RuntimeChanges, Reporting, Adopt, Quotas):
    """One enforcer: its state is set here, its methods come from the parts named above. It
    has its books (enforcer/books.py: plain data and the sums over them, given readers of the
    BPF counters and the context estimate) and its decider (enforcer/decisions.py), which it
    passes the books and acts for (write_assign, resume, resume_asks, answer_shim, kill)."""

    # the decider's settings, changed by a reload (enforcer/runtime.py) and shown by status
    policy = property(lambda self: self.decider.policy, lambda self, v: setattr(self.decider, "policy", v))
    max_wait = property(lambda self: self.decider.max_wait, lambda self, v: setattr(self.decider, "max_wait", v))
    over_limit = property(lambda self: self.decider.over_limit,
                          lambda self, v: setattr(self.decider, "over_limit", v))

    def __init__(self, tracer, policy: str, capacity: dict[int, int], rules: LimitRules,
                 stopper=None, over_limit: str = "stall", ctx_overhead: int | None = None,
                 max_wait: float = policies.MAX_WAIT, seed: int | None = None, engines=None,
                 container_of=container_of_pid, run_dir: str = "/run/convgpu", nvml=None,
                 reload=None, physical: dict[int, int] | None = None, unprobed: str = "stall",
                 state_dir: str | None = None, quota: MapQuota | None = None,
                 unmapped_charge: str = "all"):
        self.tracer, self.capacity, self.rules = tracer, capacity, rules
        # the card's memory convgpu may count on (NVML's total less --reserve); unknown, the
        # capacity: then an exit's memory returns to the pool only once the driver freed it
        self.physical = {d: max(c, (physical or {}).get(d, c)) for d, c in capacity.items()}
        self.stopper = stopper or SignalStopper()
        self.ctx_overhead = ctx_overhead   # --ctx-overhead: None unless the operator gave it
        self.nvml = nvml
        self._gpu_infos = self._read_gpus()   # NVML's GPUs, read once (never from the loop)
        self.unprobed = unprobed   # a process that opened a driver file we cannot probe: stall|kill|allow
        self.unmapped_charge = unmapped_charge   # a process whose GPUs are not established: all|guess
        self.contradicted: dict[int, str] = {}   # pid -> what NVML's lists say against its mapping
        if self._gpu_infos and hasattr(tracer, "gpumap"):
            tracer.gpumap.gpus = list(self._gpu_infos.values())   # ordinals to host GPUs (probes/gpumap.py)
        self.quota = quota or MapQuota()   # entries per container in the BPF maps (enforcer/quotas.py)
        self.quota_held: dict[int, int] = {}   # pid -> container key: stopped at a quota
        self.engines = engines
        self.reload_config = reload   # () -> (LimitRules, settings dict); raises ConfigError
        self.container_of = container_of
        self.books = Books(capacity, self.physical, self._state, self._ctx, self._share,
                           whole=self._held_whole, freezer=not isinstance(self.stopper, SignalStopper))
        self.boxes, self.by_key, self._exits = self.books.boxes, self.books.by_key, self.books.exits   # the same dicts
        self.decider = Decider(self.books, self, policy, random.Random(seed), max_wait, over_limit,
                               process_holds=self._process_holds, holder=lambda: self.holder)
        self.over_limit_asked = over_limit   # in force unless the decisions are unreadable (runtime.py)
        # run-time limits and names, kept in the state dir across restarts (tenants/durable.py);
        # read (and the directory locked) at start, before the first admission
        self.durable = durable.Store(state_dir)
        self.history = Recorder(HistoryFile(state_dir) if state_dir else None)   # each job's runs (history/)
        self._swept = 0.0
        self.pid_box: dict[int, Box] = {}
        self.names: dict[str, str] = {}   # cgroup -> name given by `convgpu run --name`
        self.shimmed: set[int] = set()    # pids under the preload shim: they wait, never stop
        self.broker = ShimBroker(self)
        self._next_key = 1
        self._measured = 0.0
        self.heartbeat = Heartbeat(self._write_control, HEARTBEAT_EVERY, LOOP_HUNG)
        self._control_lock = threading.Lock()   # the loop and the heartbeat thread write control
        self._leaf: dict = {}                   # control's fields but the heartbeat
        self._exempt = 0    # a self-test child's pid, which admission skips
        self._viewed = -VIEW_GRACE         # last snapshot asked for by a view (`convgpu trace`)
        self._told = 0                     # the waiters count last written to BPF
        self._reload_asked = False
        self._held_due = 0.0               # when the state file became due (0: written)
        self.started = time.time()
        self.run_dir = run_dir
        self.state_file = os.path.join(run_dir, f"held-{os.getpid()}.json")
        self.control_path = os.path.join(run_dir, "control.sock")
        self.watchdog = None
        self.pin_dir = takeover.pin_dir_for(run_dir)
        self.owner = random.SystemRandom().randrange(1, 1 << 31)   # control.owner: who admits
        self.metrics = None   # enforcer.metrics.MetricsServer, set by the CLI
        # what `convgpu trace` shows while we run (it asks us rather than probing twice)
        self.acct = Accountant(nvml=Cached(list(self._gpu_infos.values()), lambda: self.sampler, nvml.driver)
                               if nvml is not None and nvml.ok else None,   # never NVML itself from the loop
                               ctx_overhead=None if nvml is not None and nvml.ok else ctx_overhead,
                               engines=engines, container_of_pid=container_of)
        self._published = 0.0
        self._saved = None
        self.sel = selectors.DefaultSelector()
        self.servers: list[server.Server] = []
        self.holder = None                 # ThreadHolder: a stop holds the asking thread alone (ptrace)
        self.sampler = None                # NVML's per-process memory, sampled in a thread
        # (pid, dev) -> (NVML less its tracked bytes, the contexts it had then): its measured overhead
        self.excess: dict[tuple[int, int], tuple[int, int]] = {}
        # what a context costs before NVML measures it, per device (enforcer/ctxest.py)
        self.measured = ctxest.MeasuredStore(state_dir)
        self.devices = self._devices()
        self._unmeasured: dict[str, str] = {}   # model key -> why no context is measured there (yet)
        self.est = {d: self._choose(d) for d in self.devices}
        self._measure_queue: list[tuple[str, int]] = []   # (model key, GPU) to measure a context on
        self._measure_wait: set[int] = set()     # GPUs whose newcomers wait for that measurement
        self._measuring_now = None               # the ctxmeasure.Measurement running
        self._measuring = 0                      # its child's pid: admission skips it (control.measuring)
        self._held_new: dict = {}                # (pid, tid) -> (event, also): waiting for a measurement
        self._nvml_failing = False               # said once: NVML stopped answering (overhead.py)
        # the driver's own count as the last word: over a limit however obtained (backstop.py)
        self.backstop = backstop.Backstop(self.books, self.stopper, self._place_stray, self.kill, self._waits_whole,
                                          self._own_pids, self._calls_of, self._accounted,
                                          lambda: self.decider.over_limit)
        self.backstop.off = self._backstop_off()
        self.calls_seen: dict[int, dict[str, int]] = {}   # pid -> calls no admission sizes, seen in events

    # ---- the books' readers (enforcer/books.py) ----
    def _share(self, box: Box, dev: int) -> int:
        """Its limit on one GPU: its own, or where its pod's grant spans GPUs, the pod's share
        on this one (the Kubernetes agent's split, docs/KUBERNETES.md)."""
        return self.rules.share(box.container, self._gpu_key(dev), box.limit, box.source)

    def _gpu_key(self, dev: int) -> str:
        """The GPU's key as the Kubernetes agent names it: NVML's uuid (read at start: this runs
        in the loop, where an NVML call that hangs would hold admission), else gpu<index>."""
        g = self._gpu_infos.get(dev)
        return g.uuid if g is not None and g.uuid else f"gpu{dev}"

    def _process_holds(self, box: Box, dev: int) -> dict[int, tuple[int, int]]:
        """pid -> (what it holds on dev, of that its contexts), from BPF's per-process usage
        and NVML's measured contexts (the decider reads it only when there are several
        stopped units to order)."""
        out = {}
        for u in self.tracer.usage():
            if u.dev != dev or u.pid not in box.pids:
                continue
            ctx = self.excess[(u.pid, dev)][0] if (u.pid, dev) in self.excess else max(u.contexts, 0) * self._ctx(dev)
            out[u.pid] = (u.live + ctx, ctx)
        return out

    def _held_whole(self, pid: int) -> bool:
        """A stop holds every thread of pid: ptrace refused it (or no holder), or it has one."""
        return self.holder is None or self.holder.mode(pid) == "process" or len(_tids(pid)) <= 1

    def schedule(self):
        self.decider.schedule()

    # ---- the decider's actuator (write_assign, resume, resume_asks: enforcer/actions.py) ----
    def answer_shim(self, box: Box, dev: int, wakes, answer: dict):
        self.broker.granted(box, dev, wakes, answer)

    def kill(self, pid: int):
        if alive(pid):
            os.kill(pid, signal.SIGKILL)

    def start(self) -> "Enforcer":
        from .serving.control import ControlHandler
        os.makedirs(self.run_dir, mode=0o755, exist_ok=True)
        # the control socket first: a second enforcer on the same run dir fails here, before
        # its probes could stall anything
        if _answers(self.control_path):
            from ..errors import ConfigError
            raise ConfigError(f"an enforcer already runs on {self.control_path}",
                              "stop it first, or give this one another --run-dir")
        self.durable.open()   # before anything is admitted or adopted: every limit as it was decided
        if self.durable.error:
            log.error("decisions unreadable: %s; kept as it is, and every container is held (admitted "
                      "nothing more, never killed) until it is repaired or moved aside and `convgpu "
                      "reload` reads it", self.durable.error)
        self._decided()
        raise_nofile()   # a connection is an fd: the caps (serving/peers.py) stay below the limit
        self.servers.append(server.Server(self.control_path, ControlHandler(self), 0o600,
                                          root_only=True, sel=self.sel))
        try:
            from .serving.shim import ShimHandler
        except ImportError:
            ShimHandler = None
        if ShimHandler is not None:   # any process may ask; the kernel says who it is (peers.py)
            self.servers.append(server.Server(os.path.join(self.run_dir, "shim", "shim.sock"),
                                              ShimHandler(self.broker), 0o666, root_only=False, sel=self.sel,
                                              caps=SHIM_CAPS, group_of=self._peer_group))
        self.tracer.selftest_exempt = self._exempting
        self.tracer.recheck = True
        self.tracer.selftest_later = True   # admission on first: it only reports (Tracer.poll)
        if self.tracer.kernel:
            prev = self._load_over_pins()
            shimprobes.attach(self.tracer.b)   # only calls from inside the shim wait in it
        else:
            self.tracer.start()
            prev = []
        if self.nvml is not None and self.nvml.ok:   # once the probes' maps exist: a sample reads
            from ..probes.nvml import Sampler         # them, and failed until then, which read as
            # "NVML has not answered for 7 s" at every start on a GPU host
            self.sampler = Sampler(self.nvml, backstop.SAMPLE_EVERY, self._tracked, self.tracer.calls_in_flight,
                                   contexts=True).start()
        self._wake_fd = self.tracer.fileno()
        self.sel.register(self._wake_fd, selectors.EVENT_READ, lambda _mask: None)
        reader = getattr(getattr(self.tracer, "discovery", None), "reader", None)
        if reader is not None:      # a driver file read, a process looked at: settle it at once
            self.sel.register(reader.fd, selectors.EVENT_READ, lambda _mask: reader.drain())
        signal.signal(signal.SIGHUP, self._on_hup)
        self._adopt(prev)
        if self.tracer.kernel:
            self._write_resident()   # what a stack limit costs, before a call is admitted
        self._plan_measurements()   # a GPU model never seen: its newcomers wait for a measured context
        write_state(self.state_file, [], [])
        if not self.tracer.kernel:   # shims wait in their threads: nothing to undo if we die
            log.warning("no probes (--no-probes): only processes under the preload shim are limited")
            self._control(True)
            log.info("enforcing: policy %s, capacity %s (shim only)", self.policy, self._capacity_text())
            return self
        # The watchdog (enforcer/failsafe/watchdog.py) learns of our death from a pipe; it turns
        # admission and discovery off at once and resumes whoever we held
        self.fds = takeover.FdSender()
        zero, held = self.tracer.discovery.fail_safe_fds()
        self.watchdog, self._lifeline = watchdog.spawn(os.getpid(), self.state_file, [self._t("control").map_fd, *zero],
                                                       held, self.fds.theirs, self.pin_dir)
        self.fds.theirs.close()
        self.fds.send(takeover.probe_fds(self.tracer.b))
        self.tracer.on_release = self.fds.drop
        self._save_held()
        self._control(True)
        self.tracer.discovery.on_unprobed = self._unprobed
        if isinstance(self.stopper, SignalStopper):   # the freezer holds containers whole
            self.holder = ThreadHolder(held_seq(self._t("held"))).start()
        self.tracer.enable_discovery(own_watchdog=False)
        self.heartbeat.loop_ran()
        self.heartbeat.start()
        takeover.retire(prev)   # our probes own admission now: the old ones may detach
        log.info("enforcing: policy %s, capacity %s", self.policy, self._capacity_text())
        return self

    def close(self):
        """Nothing stays stopped: every waiter is resumed, admission is turned off."""
        self.heartbeat.stop()   # before admission goes off: it would write it back on
        if self.tracer.b is not None:
            self._control(False)
        for box in self.boxes.values():
            for dev in list(box.waiting):
                self.resume(box, dev, "enforcer stopping")
        if self.holder is not None:   # after the releases above: it lets go of every thread
            self.holder.close()
            self.holder = None
        if self.tracer.kernel and self.tracer.b is not None:   # BPF stops only with probes
            self._resume_unplaced()
        for srv in self.servers:
            srv.close()
        self.servers.clear()
        if self.metrics is not None:
            self.metrics.close()
        if self.sampler is not None:
            self.sampler.close()
        if self._measuring_now is not None:   # its child goes (newcomers it held: _resume_unplaced)
            self._measuring_now.result(float("inf"))
        self._save_measured()
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
            os.close(self._lifeline)
            self.watchdog = None
            try:
                os.unlink(self.state_file)
            except OSError:
                pass
            takeover.clear(self.pin_dir)   # no probes left to keep the maps exact
        self.tracer.close(background=True)

    def step(self):
        now = time.monotonic()
        held = self.heartbeat.loop_ran()
        if held > LOOP_LATE:   # said, so a log explains the wait (and any unchecked calls)
            log.warning("the loop was held %.2f s: stalls, grants and resumes waited meanwhile%s", held,
                        "" if held < LOOP_HUNG else "; its heartbeat lapsed, and BPF admitted every "
                        "call unchecked from 2 s after that")
        if self._reload_asked:
            self._reload_asked = False
            self.reload()
        events = self.tracer.poll()
        self.acct.feed(events)
        dirty = self._take(events, now)
        if self.quota_held:
            self._quota_resume()
        if dirty:   # a resume first: the periodic work below can wait for it
            self._changed()
        if self._measuring_now is not None or self._measure_queue:
            self._measure_step(now)
        if self.sampler is not None and self.sampler.seq != self.backstop.seq:   # the driver's count
            dirty |= self.backstop.step(self.sampler.raw, self.sampler.seq, now, self.sampler.compute)
        if now - self._measured >= MEASURE_EVERY:
            self._measured = now
            # also a catch-all: frees seen only by a retiring predecessor's probes wake nobody
            if self._measure_overhead() or any(b.waiting for b in self.boxes.values()):
                self._changed()
                dirty = True
            if self.tracer.kernel:
                self.fds.send(takeover.probe_fds(self.tracer.b))   # libraries attached since
            self.history.sample(from_books(self.books, self.tracer.usage(), self.excess, self._ctx, self.names,
                                           self.rules, now, time.time()))
        self.heartbeat.beat_if_due()   # after a resume: it can wait
        self._save_held_unless_woken()
        self._sweep_decisions(now)
        if self.metrics is not None and (dirty or now - self._published >= 1.0):
            self._published = now
            self.metrics.publish(self.status(), self.tracer.usage(), self.excess)
        return events

    def _changed(self):
        self.schedule()
        # the waiters count: frees wake us (and go out, if quiet) only while someone waits,
        # so a free that came before BPF knew of its first waiter sent no event: look again
        if self._control(True) == 0 and self._told:
            self.schedule()
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
        self._save_held()

    def run(self, duration: float = 0.0, tick: float = 0.05, on_step=None):
        """Sleeps in select() on the ring buffer (a stall or, while someone waits, a free or
        exit wakes it at once) and the sockets; at least every `tick` for the heartbeat."""
        end = time.monotonic() + duration if duration else None
        while end is None or time.monotonic() < end:
            events = self.step()
            if on_step:
                on_step(events)
            server.serve(self.sel, tick, self.servers)

    def _peer_group(self, ident) -> str:
        """A shim peer's container, for the caps per container (serving/peers.py)."""
        c = self.container_of(ident.pid)
        if ident.exited():   # what we read may be of a process that took its pid since
            raise ProcessLookupError(ident.pid)
        return f"{c.kind} {c.id}"

    def _on_hup(self, *_):
        self._reload_asked = True   # handled in the loop, never inside a signal handler


def _answers(path: str) -> bool:
    try:
        server.request(path, {"cmd": "ping"}, timeout=2)
        return True
    except (OSError, ValueError):
        return False
