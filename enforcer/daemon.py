"""`convgpu enforce`: per-container GPU-memory limits, enforced by stalling (ConVGPU III-D/E).

BPF admits or stops each call before it runs (bpf/convgpu.bpf.c, "enforce"); this loop
places new processes in containers, assigns memory, and resumes waiters as the policy grants
memory. Every decision is one log line. The BPF side fails open when the heartbeat stops."""
import contextlib
import ctypes as ct
import logging
import os
import random
import select
import selectors
import signal
import threading
import time
from dataclasses import dataclass, field

from ..units import format_size
from . import ctxest, policies
from .accounting import Accountant
from .broker import SHIM_MEMBER, ShimBroker
from .containers import Container, container_of_pid
from .heartbeat import Heartbeat
from .limits import LimitRules
from .stall import SignalStopper, Target
from . import server, takeover, watchdog
from .watchdog import write_state

log = logging.getLogger(__name__)
MASK64 = (1 << 64) - 1
HEARTBEAT_EVERY = 0.25   # s; BPF stops admitting (fails open) after 2 s without one
LOOP_LATE = 1.0          # s between two passes of the loop that gets a warning
LOOP_HUNG = 30.0         # s without a pass: the heartbeat stops (enforcer/heartbeat.py)
MEASURE_EVERY = 1.0      # s; NVML's per-process memory, for the measured context overhead
LEARN_SAVE_EVERY = 10.0  # s at most between two writes of the learned context estimates
VIEW_GRACE = 10.0        # s after a view's last snapshot: alloc/free events flow (else quiet)
HELD_DEFER = 0.005       # s the state file may wait for events that woke the enforcer meanwhile
EXIT_WAIT = 10.0         # s an exit waits for its pidfd (a pid reused meanwhile never fires it)


@dataclass
class Wait:
    since: float
    pids: set[int]
    unreserved: int = 0      # requests stopped before placement: not reserved in BPF
    over_limit: bool = False
    wakes: list = field(default_factory=list)   # shim waiters: (pid, size, wake(answer))


@dataclass
class Box:
    """A container under enforcement."""
    key: int
    container: Container
    name: str
    created: float
    limit: int
    source: str
    pids: set[int] = field(default_factory=set)
    assigned: dict[int, int] = field(default_factory=dict)   # device -> A_c
    waiting: dict[int, Wait] = field(default_factory=dict)   # device -> pending stall
    stalled_s: float = 0.0
    stalls: int = 0
    grants: int = 0
    over_limits: int = 0
    restalls: int = 0
    extra: dict[int, int] = field(default_factory=dict)      # device -> measured overhead beyond the charge
    labels: dict | None = None
    adopted: dict[int, tuple[int, int]] = field(default_factory=dict)  # device -> (bytes, contexts)
    shim_pending: dict[int, int] = field(default_factory=dict)  # device -> granted to the shim, not yet allocated


class Enforcer:
    def __init__(self, tracer, policy: str, capacity: dict[int, int], rules: LimitRules,
                 stopper=None, over_limit: str = "stall", ctx_overhead: int = 0,
                 max_wait: float = policies.MAX_WAIT, seed: int | None = None, engines=None,
                 container_of=container_of_pid, run_dir: str = "/run/convgpu", nvml=None,
                 reload=None, physical: dict[int, int] | None = None, unprobed: str = "stall",
                 state_dir: str | None = None):
        policies.POLICIES[policy]   # validated by the CLI; KeyError here is a bug
        self.tracer, self.policy, self.capacity, self.rules = tracer, policy, capacity, rules
        # the card's memory convgpu may count on (NVML's total less --reserve); unknown, the
        # capacity: then an exit's memory returns to the pool only once the driver freed it
        self.physical = {d: max(c, (physical or {}).get(d, c)) for d, c in capacity.items()}
        self.stopper = stopper or SignalStopper()
        self.over_limit, self.ctx_overhead, self.max_wait = over_limit, ctx_overhead, max_wait
        self.unprobed = unprobed   # a process that opened a driver file we cannot probe: stall|kill|allow
        self.rng = random.Random(seed)
        self.engines = engines
        self.nvml = nvml
        self.reload_config = reload   # () -> (LimitRules, settings dict); raises ConfigError
        self.container_of = container_of
        self.boxes: dict[str, Box] = {}
        self.by_key: dict[int, Box] = {}
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
        self._stuck: set[int] = set()     # devices where every container waits and none can run
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
        self.acct = Accountant(nvml=nvml, ctx_overhead=None if nvml is not None and nvml.ok else ctx_overhead,
                               engines=engines, container_of_pid=container_of)
        self._published = 0.0
        self._saved = None
        self.sel = selectors.DefaultSelector()
        self.servers: list[server.Server] = []
        self._exits: dict[int, tuple[int, float, dict]] = {}   # pidfd -> (pid, give up at, {dev: bytes held})
        self.sampler = None                # NVML's per-process memory, sampled in a thread
        # (pid, dev) -> (NVML less its tracked bytes, the contexts it had then): its measured overhead
        self.excess: dict[tuple[int, int], tuple[int, int]] = {}
        # what a context costs before NVML measures it, per device (enforcer/ctxest.py)
        self.learned = ctxest.LearnedStore(state_dir)
        self.devices = self._devices()
        self.est = {d: self._choose(d) for d in self.devices}
        self._peak: dict[tuple[int, int], int] = {}    # (pid, dev) -> largest measured per context
        self._learn_saved = 0.0

    # --- BPF maps ---
    def _t(self, name):
        return self.tracer.b[name.encode()]

    def _control(self, enforcing: bool) -> int:
        """Writes the control map; returns the waiters count BPF knew before."""
        told, self._told = self._told, sum(len(b.waiting) for b in self.boxes.values())
        # a context call of a process not placed yet reserves this (placed: its device's estimate)
        self._leaf = dict(ctx_overhead=max((e.bytes for e in self.est.values()), default=self.ctx_overhead),
                          enforcing=int(enforcing), exempt=self._exempt,
                          over_limit_kill=int(self.over_limit == "kill"), waiters=self._told,
                          owner=self.owner, quiet=int(enforcing and self._quiet()))
        self._write_control()
        return told

    def _write_control(self):
        """The latest fields with a fresh heartbeat: read under the lock, so the heartbeat
        thread never writes back fields older than the loop's last write."""
        with self._control_lock:
            t = self._t("control")
            t[ct.c_int(0)] = t.Leaf(heartbeat_ns=time.monotonic_ns(), **self._leaf)

    def _quiet(self) -> bool:
        return time.monotonic() - self._viewed > VIEW_GRACE

    def _write_assign(self, box: Box, dev: int):
        t = self._t("assign")
        nbytes, nctx = box.adopted.get(dev, (0, 0))
        t[t.Key(container=box.key, dev=dev)] = t.Leaf(limit=box.limit, assigned=box.assigned[dev],
                                                      extra_overhead=box.extra.get(dev, 0),
                                                      adopted=nbytes, adopted_contexts=nctx,
                                                      ctx_charge=self._ctx(dev))

    def _state(self, box: Box, dev: int):
        t = self._t("cgstate")
        try:
            return t[t.Key(container=box.key, dev=dev)]
        except KeyError:
            return None

    # --- life cycle ---
    def start(self) -> "Enforcer":
        from .control import ControlHandler
        os.makedirs(self.run_dir, mode=0o755, exist_ok=True)
        if self.nvml is not None and self.nvml.ok:
            from ..probes.nvml import Sampler
            self.sampler = Sampler(self.nvml, MEASURE_EVERY, self._tracked, self.tracer.calls_in_flight,
                                   contexts=True).start()
        # the control socket first: a second enforcer on the same run dir fails here, before
        # its probes could stall anything
        if _answers(self.control_path):
            from ..errors import ConfigError
            raise ConfigError(f"an enforcer already runs on {self.control_path}",
                              "stop it first, or give this one another --run-dir")
        self.servers.append(server.Server(self.control_path, ControlHandler(self), 0o600,
                                          root_only=True, sel=self.sel))
        try:
            from .shim import ShimHandler
        except ImportError:
            ShimHandler = None
        if ShimHandler is not None:   # any process may ask; SO_PEERCRED says who it is
            self.servers.append(server.Server(os.path.join(self.run_dir, "shim", "shim.sock"),
                                              ShimHandler(self.broker), 0o666, root_only=False, sel=self.sel))
        self.tracer.selftest_exempt = self._exempting
        self.tracer.recheck = True
        if self.tracer.kernel:
            prev = self._load_over_pins()
        else:
            self.tracer.start()
            prev = []
        self._wake_fd = self.tracer.fileno()
        self.sel.register(self._wake_fd, selectors.EVENT_READ, lambda _mask: None)
        signal.signal(signal.SIGHUP, self._on_hup)
        self._adopt(prev)
        write_state(self.state_file, [], [])
        if not self.tracer.kernel:   # shims wait in their threads: nothing to undo if we die
            log.warning("no probes (--no-probes): only processes under the preload shim are limited")
            self._control(True)
            log.info("enforcing: policy %s, capacity %s (shim only)", self.policy, self._capacity_text())
            return self
        # The watchdog (enforcer/watchdog.py) learns of our death from a pipe; it turns
        # admission and discovery off at once and resumes whoever we held
        self.fds = takeover.FdSender()
        zero, held = self.tracer.discovery.fail_safe_fds()
        self.watchdog, self._lifeline = watchdog.spawn(os.getpid(), self.state_file, [self._t("control").map_fd, *zero],
                                                       held, self.fds.theirs, self.pin_dir)
        self.fds.theirs.close()
        self.fds.send(takeover.probe_fds(self.tracer.b))
        self._save_held()
        self._control(True)
        self.tracer.discovery.on_unprobed = self._unprobed
        self.tracer.enable_discovery(own_watchdog=False)
        self.heartbeat.loop_ran()
        self.heartbeat.start()
        takeover.retire(prev)   # our probes own admission now: the old ones may detach
        log.info("enforcing: policy %s, capacity %s", self.policy, self._capacity_text())
        return self

    def _unprobed(self, pid: int, lib, reason: str) -> str:
        """probes/discovery.py asks: pid opened a driver file that cannot be probed. Its calls
        would go unchecked, so by default it stays stopped (fail closed; `status` says why)."""
        what = {"stall": "kept stopped until it is killed or the enforcer stops",
                "kill": "killed", "allow": "let run UNCHECKED"}[self.unprobed]
        log.error("pid %d opened %s, which cannot be probed (%s): %s (--unprobed %s)", pid, lib, reason,
                  what, self.unprobed)
        return self.unprobed

    def _capacity_text(self) -> str:
        return ", ".join(f"GPU{d} {format_size(c)}" for d, c in sorted(self.capacity.items()))

    def _load_over_pins(self) -> list[dict]:
        """Load the BPF program over the maps a crashed enforcer left pinned (and its watchdog
        kept exact), or over fresh ones."""
        prev = takeover.previous(self.run_dir, self.state_file)
        self.tracer.owner = self.owner   # admission checks who owns it
        if not takeover.ensure_bpffs():
            self.tracer.start()
            return []
        if not prev:
            takeover.clear(self.pin_dir)   # no successor-to-be left them: stale
        os.makedirs(self.pin_dir, mode=0o700, exist_ok=True)
        self.tracer.cflags = (f'-DPIN_DIR="{self.pin_dir}"',)
        try:
            self.tracer.start()
        except Exception as e:   # an older layout of the maps: start afresh
            if not prev:
                raise
            log.warning("cannot load over the pinned maps (%s): the accounting starts afresh", e)
            self.tracer.close()
            takeover.clear(self.pin_dir)
            os.makedirs(self.pin_dir, mode=0o700, exist_ok=True)
            self.tracer.start()
            return []
        return prev

    def _adopt(self, prev: list[dict]):
        """Containers, assignments and counters of the enforcer before us, from the pinned
        maps (exact) and its state file (names, ages, counters)."""
        if not prev:
            return
        info = {}
        for st in prev:
            info.update(st.get("boxes", {}))
        members = self._t("members")
        pids: dict[int, set[int]] = {}
        for k, v in list(members.items()):
            if _alive(k.value):
                pids.setdefault(v.value & ~SHIM_MEMBER, set()).add(k.value)
            else:
                del members[k]
        for name in ("assign", "cgstate"):
            t = self._t(name)
            for k, a in list(t.items()):
                if k.container not in pids:
                    del t[k]
        charge = {}   # (container, dev) -> the per-context charge the old enforcer wrote
        for k, a in self._t("assign").items():
            box = self.by_key.get(k.container)
            if box is None:
                old = info.get(str(k.container), {})
                try:
                    c = self.container_of(min(pids[k.container]))
                except Exception:
                    continue
                name = old.get("name") or self.names.get(c.cgroup, c.short)
                limit, source = self.rules.limit_for(c, name, old.get("labels"))
                box = Box(k.container, c, name, time.monotonic() - (time.time() - old.get("created", time.time())),
                          self._capped(name, limit), source, labels=old.get("labels"))
                for key in ("stalled_s", "stalls", "grants", "over_limits", "restalls"):
                    setattr(box, key, old.get(key, 0))
                box.pids = pids[k.container]
                self.boxes[c.id] = box
                self.by_key[box.key] = box
                self.pid_box.update({p: box for p in box.pids})
            box.assigned[k.dev] = a.assigned
            box.extra[k.dev] = a.extra_overhead
            box.adopted[k.dev] = (a.adopted, a.adopted_contexts)
            charge[(box.key, k.dev)] = a.ctx_charge
        for box in self.boxes.values():
            for dev in box.assigned:
                # its extra was relative to the old per-context charge (our estimate may differ,
                # e.g. a median learned but not yet saved): keep the container's total as it was
                _, contexts, _ = self._usage(box, dev)
                box.extra[dev] += contexts * (charge.get((box.key, dev), self._ctx(dev)) - self._ctx(dev))
                self._write_assign(box, dev)
        self._next_key = max(self.by_key, default=0) + 1
        log.info("took over from enforcer %s: %d containers, %s assigned", 
                 ", ".join(os.path.basename(st["path"])[5:-5] for st in prev), len(self.boxes),
                 format_size(sum(sum(b.assigned.values()) for b in self.boxes.values())))

    @contextlib.contextmanager
    def _exempting(self, pid: int):
        """BPF does not admit pid meanwhile: a self-test child that calls every symbol of a
        library just attached (it would stall). Everyone else stays checked: turning admission
        off instead let any process allocate unchecked while the child ran. Admission itself
        stays as it was (off during start-up, until the watchdog runs)."""
        enforcing = bool(self._leaf.get("enforcing"))
        self._exempt = pid
        self._control(enforcing)
        try:
            yield
        finally:
            self._exempt = 0
            self._control(enforcing)

    def close(self):
        """Nothing stays stopped: every waiter is resumed, admission is turned off."""
        self.heartbeat.stop()   # before admission goes off: it would write it back on
        if self.tracer.b is not None:
            self._control(False)
        for box in self.boxes.values():
            for dev in list(box.waiting):
                self._resume(box, dev, "enforcer stopping")
        for srv in self.servers:
            srv.close()
        self.servers.clear()
        if self.metrics is not None:
            self.metrics.close()
        if self.sampler is not None:
            self.sampler.close()
        for (pid, dev), per_ctx in sorted(self._peak.items()):   # still running: learned too
            self.learned.add(self.devices[dev].key, per_ctx)
        self._peak.clear()
        self._save_learned(force=True)
        # admission is off and nobody waits: the probes may detach after we are gone (seconds
        # to minutes for hundreds of probes: a stop, or a restart by systemd, need not wait)
        self.tracer.close(background=True)
        if self.watchdog is not None:   # nothing is held now: it has nothing left to do
            self.watchdog.kill()
            self.watchdog.wait()
            try:
                os.unlink(self.state_file)
            except OSError:
                pass
            takeover.clear(self.pin_dir)   # no probes left to keep the maps exact

    def _save_held(self):
        """What the watchdog must undo if we die: every waiting pid, every frozen cgroup."""
        pids, cgroups = set(), set()
        for box in self.boxes.values():
            for w in box.waiting.values():
                pids |= w.pids
                if not isinstance(self.stopper, SignalStopper):
                    pids |= box.pids
                    cgroups.add(self.stopper.root.rstrip("/") + box.container.cgroup)
        boxes = {str(b.key): {"name": b.name, "created": int(time.time() - (time.monotonic() - b.created)),
                              "labels": b.labels, "stalled_s": b.stalled_s, "stalls": b.stalls,
                              "grants": b.grants, "over_limits": b.over_limits, "restalls": b.restalls}
                 for b in self.boxes.values()}
        state = (sorted(pids), sorted(cgroups), boxes, self.watchdog.pid if self.watchdog else None)
        if state == self._saved:   # the file is rewritten (rename) only when it changes
            return
        self._saved = state
        write_state(self.state_file, pids, cgroups, boxes=boxes, saved=time.time(), watchdog=state[3])

    # --- the loop ---
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
        dirty = False
        if self._exits:     # for callers of step() alone; run() wakes on them in select()
            late = [fd for fd, (_, until, _) in self._exits.items() if now > until]
            for fd in set(select.select(list(self._exits), [], [], 0)[0] + late):
                self._reap(fd)
                dirty = True
        for e in events:
            if e.op == "unknown":
                if e.restall:
                    self._restalled(e)
                self._place(e.pid, max(e.dev, 0), e.size)
                dirty = True
            elif e.op in ("stall", "over_limit"):
                box = self.by_key.get(e.addr)
                if box is not None:
                    if e.restall:
                        self._restalled(e, box)
                    else:
                        log.info("stall %s pid %d on GPU%d: %s %s would bring it to %s (assigned %s)",
                                 box.name, e.pid, max(e.dev, 0), e.api, format_size(e.size),
                                 format_size(e.live), format_size(box.assigned.get(max(e.dev, 0), 0)))
                    self._waiter(box, max(e.dev, 0), e.pid, 0)   # schedule() tells over-limit
                dirty = True
            elif e.op == "exec":
                self._gone(e.pid)
                dirty = True
            elif e.op == "exit":
                self._exiting(e.pid, e.size, e.ts_ns, contexts=e.live)
                dirty = True
            elif e.op in ("free", "ctx_destroy"):   # room for someone, if anyone waits
                dirty = dirty or any(b.waiting for b in self.boxes.values())
        if dirty:   # a resume first: the periodic work below can wait for it
            self._changed()
        if now - self._measured >= MEASURE_EVERY:
            self._measured = now
            # also a catch-all: frees seen only by a retiring predecessor's probes wake nobody
            if self._measure_overhead() or any(b.waiting for b in self.boxes.values()):
                self._changed()
                dirty = True
            if self.tracer.kernel:
                self.fds.send(takeover.probe_fds(self.tracer.b))   # libraries attached since
            self._save_learned()
        self.heartbeat.beat_if_due()   # after a resume: it can wait
        self._save_held_unless_woken()
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

    def _exiting(self, pid: int, tracked: int = 0, at: int = 0, contexts: int = 0):
        """The last thread of pid is in exit: it leaves its container now, but the driver frees
        its device memory only when the kernel closes its files, after the event (do_exit: the
        tracepoint, exit_mm, exit_files), 55 ms later on the H100. Until its pidfd becomes
        readable (exit_notify) those bytes are held against the card's physical room (see
        _room), so a waiter resumes at once where the card has room for both, and only
        once they are back where it has not. tracked: its live bytes and context charges;
        at: the exit tracepoint's time (CLOCK_MONOTONIC ns), for the timeline; contexts: how
        many it had (measured by NVML: what NVML said; else the estimate each)."""
        t = time.monotonic_ns()
        box = self.pid_box.get(pid)
        devs = sorted(box.assigned) if box else []
        # on every device of its container: the event gives one total (where, BPF has forgotten)
        measured = [self.excess[(pid, d)] for d in devs if (pid, d) in self.excess]
        unmeasured = max(0, contexts - sum(n for _, n in measured))
        held = (tracked + sum(over for over, _ in measured)
                + unmeasured * max((self._ctx(d) for d in devs), default=self.ctx_overhead))
        log.debug("pid %d exiting, %d bytes held (kernel t=%d) (t=%d)", pid, held, at, t)   # bench.sched.resume
        self._gone(pid)
        if not held or not devs:
            return
        try:
            fd = os.pidfd_open(pid)
        except OSError:     # reaped already
            return
        self._exits[fd] = (pid, time.monotonic() + EXIT_WAIT, {d: held for d in devs})
        if select.select([fd], [], [], 0)[0]:
            self._reap(fd)
            return
        self.sel.register(fd, selectors.EVENT_READ, lambda _mask, fd=fd: (self._reap(fd), self._changed()))

    def _reap(self, fd: int):
        pid, _, _ = self._exits.pop(fd)
        try:
            self.sel.unregister(fd)
        except KeyError:
            pass
        os.close(fd)
        log.debug("pid %d gone (t=%d)", pid, time.monotonic_ns())

    def _tearing(self, dev: int) -> int:
        """Bytes of exited processes that the driver has not freed yet."""
        return sum(held.get(dev, 0) for _, _, held in self._exits.values())

    def _assigned(self, dev: int) -> int:
        return sum(b.assigned.get(dev, 0) for b in self.boxes.values())

    def _room(self, dev: int) -> int:
        """The card's physical room once every container fills its assignment, with what
        exiting processes still hold: a resume needs it >= 0 (a grant, too, after it)."""
        return self.physical.get(dev, 0) - self._assigned(dev) - self._tearing(dev)

    def _free(self, dev: int) -> int:
        """What may be assigned on dev: the capacity's unassigned memory, within the room."""
        return max(0, min(self.capacity.get(dev, 0) - self._assigned(dev), self._room(dev)))

    def _restalled(self, e, box: Box | None = None):
        if box is not None:
            box.restalls += 1
        log.warning("pid %d%s resumed without a grant (SIGCONT from outside?): stopped again "
                    "before its %s ran", e.pid, f" of {box.name}" if box else "", e.api)

    def run(self, duration: float = 0.0, tick: float = 0.05, on_step=None):
        """Sleeps in select() on the ring buffer (a stall or, while someone waits, a free or
        exit wakes it at once) and the sockets; at least every `tick` for the heartbeat."""
        end = time.monotonic() + duration if duration else None
        while end is None or time.monotonic() < end:
            events = self.step()
            if on_step:
                on_step(events)
            server.serve(self.sel, tick)

    def _on_hup(self, *_):
        self._reload_asked = True   # handled in the loop, never inside a signal handler

    # --- placement ---
    def _box_for(self, pid: int) -> Box | None:
        try:
            c = self.container_of(pid)
        except Exception:
            return None
        box = self.boxes.get(c.id)
        if box is None:
            meta = self.engines.lookup_sync(c) if self.engines is not None else None
            name = meta.name if meta and meta.name else self.names.get(c.cgroup, c.short)
            labels = meta.labels if meta else None
            limit, source = self.rules.limit_for(c, name, labels)
            box = Box(self._next_key, c, name, time.monotonic(), self._capped(name, limit), source,
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

    def _place(self, pid: int, dev: int, request: int):
        box = self._box_for(pid)
        if box is None:     # gone before we could place it: nothing to hold
            os.kill(pid, signal.SIGCONT) if _alive(pid) else None
            return
        self._join(box, pid, dev, request)
        self._waiter(box, dev, pid, request, count=False)
        if self._demand(box, dev) > box.assigned[dev]:   # placed, but nothing to run on yet
            box.stalls += 1
            log.info("stall %s pid %d on GPU%d: placed with %s assigned, needs %s", box.name, pid,
                     dev, format_size(box.assigned[dev]), format_size(self._demand(box, dev)))

    def _join(self, box: Box, pid: int, dev: int | None = None, request: int = 0, usage=None):
        """pid is in box from now on. What it allocated before (while no enforcer admitted, or
        in calls that are not admitted) was charged to no container: adopt it. Read before the
        membership is written, so a racing free can only make this an over-count. A member
        placed again (its first context on another GPU) adopts nothing on the GPUs the box has:
        BPF charged its bytes there already."""
        charged = set(box.assigned) if self.pid_box.get(pid) is box else set()
        held = {u.dev: (u.live, max(u.contexts, 0)) for u in (usage or self.tracer.usage())
                if u.pid == pid and u.dev not in charged and (u.live or u.contexts > 0)}
        self._t("members")[ct.c_uint(pid)] = ct.c_ulonglong(box.key)
        box.pids.add(pid)
        self.pid_box[pid] = box
        for d in sorted(set(held) | ({dev} if dev is not None else set())):
            if d not in box.assigned:
                self._new_device(box, d, request if d == dev else 0)
        for d, (nbytes, nctx) in held.items():
            b0, c0 = box.adopted.get(d, (0, 0))
            box.adopted[d] = (b0 + nbytes, c0 + nctx)
            self._write_assign(box, d)
            log.info("container %s GPU%d: pid %d already held %s in %d contexts: adopted", box.name,
                     d, pid, format_size(nbytes), nctx)

    def _new_device(self, box: Box, dev: int, request: int = 0):
        """First context of a container on a device: A_c = min(L_c, unassigned), cut to what
        keeps the device safe, 0 (it waits) where even the call it is stopped at (`request`,
        on top of what it already holds) is not (policies.assign_new)."""
        free = self._free(dev)
        held = self._held(box, dev)
        box.assigned[dev] = policies.assign_new(box.limit, free, self._claims(dev, but=box),
                                                self.capacity.get(dev, 0), held, held + request,
                                                box.container.id)
        self._ensure_state(box, dev)
        self._write_assign(box, dev)
        log.info("container %s GPU%d: assigned %s (limit %s)", box.name, dev,
                 format_size(box.assigned[dev]), format_size(box.limit))

    def _capped(self, name: str, limit: int) -> int:
        cap = max(self.capacity.values())
        if limit > cap:
            log.warning("container %s: limit %s above capacity %s: capped", name,
                        format_size(limit), format_size(cap))
        return min(limit, cap)

    def _ensure_state(self, box: Box, dev: int):
        """BPF charges a container's bytes on a device once this entry exists (never reset:
        a shim process may have been charged before the device was assigned)."""
        st = self._t("cgstate")
        k = st.Key(container=box.key, dev=dev)
        try:
            st[k]
        except KeyError:
            st[k] = st.Leaf()

    def _waiter(self, box: Box, dev: int, pid: int, unreserved: int, count: bool = True):
        self.broker.revoke(box, dev)   # credit of the container's shim processes: for the waiter
        w = box.waiting.get(dev)
        if w is None:
            w = box.waiting[dev] = Wait(time.monotonic(), set())
            box.stalls += count
        if pid not in w.pids or pid in self.shimmed:   # a re-stall is not a second request
            w.unreserved += unreserved
        w.pids.add(pid)
        if isinstance(self.stopper, SignalStopper) or pid in self.shimmed:
            return w
        # freezer mode: hold the whole container in its cgroup, then drop the signal stop,
        # so that no SIGCONT from inside the container can undo the stall
        try:
            self.stopper.stall(Target(tuple(box.pids), box.container.cgroup))
            for p in box.pids:
                os.kill(p, signal.SIGCONT) if _alive(p) else None
        except Exception as e:
            log.warning("container %s: freezer failed (%s); it stays signal-stopped", box.name, e)
        return w

    def _gone(self, pid: int):
        self._learn(pid)
        if pid in self.shimmed:
            self.broker.shim_gone(pid)
        box = self.pid_box.pop(pid, None)
        if box is None:
            return
        box.pids.discard(pid)
        settled = False
        for dev, w in list(box.waiting.items()):
            w.pids.discard(pid)
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
            del self.boxes[box.container.id]
            del self.by_key[box.key]
            log.info("container %s exited: %s back to the pool", box.name,
                     format_size(sum(box.assigned.values())))

    # --- scheduling ---
    def _usage(self, box: Box, dev: int) -> tuple[int, int, int]:
        """(live bytes, contexts, reserved) of a container on a device: BPF's counters plus
        what was adopted at placement (BPF's `used` may have wrapped below zero: see charged()
        in bpf/convgpu.bpf.c)."""
        s = self._state(box, dev)
        nbytes, nctx = box.adopted.get(dev, (0, 0))
        if s is None:
            return nbytes, nctx, 0
        return (s.used + nbytes) & MASK64, max(s.contexts + nctx, 0), s.reserved

    def _demand(self, box: Box, dev: int) -> int:
        """U_c plus what is pending: everything the container needs to run on."""
        used, contexts, reserved = self._usage(box, dev)
        w = box.waiting.get(dev)
        return (self._ctx_held(box, dev, used, contexts) + reserved
                + box.shim_pending.get(dev, 0) + (w.unreserved if w else 0))

    def _ctx_held(self, box: Box, dev: int, used: int, contexts: int) -> int:
        """used plus its contexts: the estimate each, turned into NVML's measurement for the
        measured ones by box.extra (never below zero, as charged() in bpf/convgpu.bpf.c)."""
        return max(0, used + contexts * self._ctx(dev) + box.extra.get(dev, 0))

    def schedule(self):
        now = time.monotonic()
        for dev in sorted(self.capacity):
            if self._room(dev) < 0:   # an exit's memory is still in the driver and the card is full
                continue              # of assignments: any resume could fail there; its pidfd wakes us
            waiting = [b for b in self.boxes.values() if dev in b.waiting]
            for box in waiting:   # a free inside the container may be enough
                demand = self._demand(box, dev)
                if demand <= box.assigned[dev] and demand <= box.limit:
                    # running, it may use all of its assignment: only as much as is safe
                    me = policies.Claim(box.container.id, box.limit, self._held(box, dev))
                    top = policies.safe_assignment(me, self._claims(dev), self.capacity.get(dev, 0),
                                                   demand, box.assigned[dev])
                    if top is not None:
                        if top < box.assigned[dev]:
                            box.assigned[dev] = top
                            self._write_assign(box, dev)
                        self._resume(box, dev, "fits its assignment")
            if (not self._grant(dev, now) and not self._tearing(dev) and self._reclaim(dev)
                    and not self._grant(dev, now, fit_only=True)):
                self._deadlock(dev)   # on the reclaimed pool, only who can run: nobody can

    def _grant(self, dev: int, now: float, fit_only: bool = False) -> bool:
        """One pass of the policy over the waiters on dev; True if it resumed one."""
        cands = []
        for box in self.boxes.values():
            if dev not in box.waiting:
                continue
            demand = self._demand(box, dev)
            if demand > box.limit:
                self._over_limit(box, dev, demand)
                continue
            w = box.waiting[dev]
            cands.append(policies.Waiter(id=box.container.id, created=box.created,
                                         suspended_at=w.since, limit=box.limit,
                                         assigned=box.assigned[dev], used=demand, request=0,
                                         held=self._held(box, dev)))
        free = self._free(dev)
        resumed = False
        ids = {c.id for c in cands}
        others = [c for c in self._claims(dev) if c.id not in ids]   # runners, and the stuck
        for g in policies.schedule(self.policy, cands, free, now, self.rng, self.max_wait, fit_only,
                                   others, self.capacity.get(dev, 0)):
            box = self.boxes[g.id]
            box.assigned[dev] += g.amount
            box.grants += 1
            self._write_assign(box, dev)
            log.info("grant %s to %s on GPU%d (assigned %s)", format_size(g.amount), box.name,
                     dev, format_size(box.assigned[dev]))
            if g.resume:
                self._resume(box, dev, f"policy {self.policy}")
                resumed = True
        return resumed

    def _claims(self, dev: int, but: Box | None = None) -> list[policies.Claim]:
        """The banker's view of dev (policies.schedule says why): a running container holds its
        assignment (it allocates up to it without asking), a waiter what it uses (its unused
        assignment can be reclaimed), a waiter over its limit the same, for good (stuck)."""
        out = []
        for b in self.boxes.values():
            if dev not in b.assigned or b is but:
                continue
            held = self._held(b, dev)
            w = b.waiting.get(dev)
            out.append(policies.Claim(b.container.id, b.limit,
                                      max(held, b.assigned[dev]) if w is None else held,
                                      stuck=w is not None and (w.over_limit or self._demand(b, dev) > b.limit)))
        return out

    def _reclaim(self, dev: int) -> bool:
        """Every container on dev paused, nobody resumed: see policies.reclaim."""
        on = [b for b in self.boxes.values() if dev in b.assigned]
        waiting = {b.container.id: (b.assigned[dev], self._held(b, dev)) for b in on if dev in b.waiting}
        within = any(not b.waiting[dev].over_limit for b in on if dev in b.waiting)
        back = policies.reclaim(waiting, any(dev not in b.waiting for b in on), within) if waiting else {}
        for cid, held in back.items():
            box = self.boxes[cid]
            log.warning("reclaim %s from %s on GPU%d: every container waits, none can run on what "
                        "it was given", format_size(box.assigned[dev] - held), box.name, dev)
            box.assigned[dev] = held
            self._write_assign(box, dev)
        return bool(back)

    def _deadlock(self, dev: int):
        """What waiters hold themselves (their contexts) leaves too little for any of them:
        only an exit ends it. Said once, until someone runs again. With every grant and
        placement safe (policies.schedule) the policies never lead here; a state made unsafe
        from outside can (a waiter over its limit holding memory, a limit raised at run time,
        a context measured larger than charged)."""
        if dev in self._stuck:
            return
        self._stuck.add(dev)
        free = self._free(dev)
        log.warning("GPU%d deadlocked: every container waits, and none can run on the %s free (the "
                    "rest is held by the waiters themselves, their contexts): it ends when one of them "
                    "exits", dev, format_size(free))

    def _held(self, box: Box, dev: int) -> int:
        """What the container holds now: its demand less the requests it is stopped at."""
        used, contexts, _ = self._usage(box, dev)
        return self._ctx_held(box, dev, used, contexts) + box.shim_pending.get(dev, 0)

    def _over_limit(self, box: Box, dev: int, demand: int):
        w = box.waiting[dev]
        if not w.over_limit:
            w.over_limit = True
            box.over_limits += 1
            log.warning("container %s GPU%d: needs %s, above its limit %s: %s", box.name, dev,
                        format_size(demand), format_size(box.limit),
                        "killing it" if self.over_limit == "kill" else "stalled until the limit is raised")
        if w.wakes:   # the shim can fail the call: a real out-of-memory error
            self.broker.granted(box, dev, w.wakes, {"deny": f"{box.name} needs {format_size(demand)}, "
                                                            f"above its limit {format_size(box.limit)}"})
            for pid, size, _ in w.wakes:
                w.unreserved -= size
                w.pids.discard(pid)
            w.wakes.clear()
            if not w.pids:
                del box.waiting[dev]
            return
        if self.over_limit == "kill":
            for p in list(w.pids):
                os.kill(p, signal.SIGKILL) if _alive(p) else None

    def _resume(self, box: Box, dev: int, why: str):
        w = box.waiting.pop(dev, None)
        if w is None:
            return
        box.stalled_s += time.monotonic() - w.since
        self._stuck.discard(dev)
        self.broker.granted(box, dev, w.wakes, {"grant": True})
        if isinstance(self.stopper, SignalStopper):
            self.stopper.resume(Target(tuple(w.pids - self.shimmed)))
        elif box.waiting:   # freezer: thawed, its process on another GPU would meet no grant
            log.info("resume %s on GPU%d after %.3f s (%s); it stays frozen until GPU%s %s",
                     box.name, dev, time.monotonic() - w.since, why,
                     ", GPU".join(map(str, sorted(box.waiting))), "settles" if len(box.waiting) == 1 else "settle")
            return
        else:
            self._thaw(box)
        log.debug("resumed %s pids %s (t=%d)", box.name, sorted(w.pids), time.monotonic_ns())
        log.info("resume %s on GPU%d after %.3f s (%s)", box.name, dev, time.monotonic() - w.since, why)

    def _thaw(self, box: Box):
        """Freezer: the container runs again, and no process of it stays signal-stopped. Only
        once none of its devices waits: a container frozen on two GPUs has both grants settled
        first (schedule() grants per device, and a thaw at the first grant let the process
        waiting on the other GPU into its call before that GPU's grant)."""
        self.stopper.resume(Target(tuple(box.pids), box.container.cgroup))
        self._signal(box.pids, signal.SIGCONT)

    @staticmethod
    def _signal(pids, sig):
        for p in pids:
            if _alive(p):
                os.kill(p, sig)

    # --- run-time changes (control socket, SIGHUP) ---
    def find(self, container: str) -> Box:
        for box in self.boxes.values():
            if container in (box.name, box.container.id, box.container.short, box.container.cgroup):
                return box
        for box in self.boxes.values():
            if len(container) >= 6 and box.container.id.startswith(container):
                return box
        raise KeyError(container)

    def set_limit(self, container: str, limit: int) -> Box:
        """`convgpu limit set`: until the container exits, beats every other source."""
        box = self.find(container)
        self.rules.runtime[box.container.id] = limit
        self._apply_limit(box, self._capped(box.name, limit), "convgpu limit set")
        return box

    def _apply_limit(self, box: Box, limit: int, source: str):
        """A new limit: an over-limit waiter may now fit; a lower one takes effect at the next
        allocation (memory already assigned is not taken back)."""
        if (limit, source) == (box.limit, box.source):
            return
        box.limit, box.source = limit, source
        for dev in box.assigned:
            self.broker.revoke(box, dev)
            box.assigned[dev] = min(box.assigned[dev], max(limit, self._demand(box, dev)))
            self._write_assign(box, dev)
            if dev in box.waiting:
                box.waiting[dev].over_limit = False
        log.info("limit of %s set to %s (%s)", box.name, format_size(limit), source)
        self.schedule()

    def register_run(self, cgroup: str, limit: int, name: str | None):
        """`convgpu run`: a cgroup of its own with this limit, before its first CUDA call."""
        self.rules.explicit[cgroup] = limit
        if name:
            self.names[cgroup] = name
        log.info("convgpu run: %s (%s) limit %s", name or cgroup, cgroup, format_size(limit))

    def reload(self) -> bool:
        """SIGHUP / `convgpu reload`: new rules for new containers and for running ones whose
        limit came from a rule, a label or the default. A bad file keeps the last good config."""
        if self.reload_config is None:
            log.warning("reload: no config file was given (--config)")
            return False
        from ..errors import ConvgpuError
        try:
            rules, settings = self.reload_config()
        except ConvgpuError as e:
            log.error("reload failed, keeping the last good config: %s", e)
            return False
        rules.explicit.update({k: v for k, v in self.rules.explicit.items() if k.startswith("/")})
        rules.runtime = self.rules.runtime
        rules.pods = self.rules.pods       # the Kubernetes agent's, not the file's
        self.rules = rules
        if "policy" in settings and settings["policy"] != self.policy:
            log.info("policy %s -> %s", self.policy, settings["policy"])
            self.policy = settings["policy"]
        self.max_wait = settings.get("max_wait", self.max_wait)
        for box in list(self.boxes.values()):
            limit, source = rules.limit_for(box.container, box.name, box.labels)
            self._apply_limit(box, self._capped(box.name, limit), source)
        log.info("config reloaded: %d rules, default limit %s", len(rules.rules),
                 format_size(rules.default))
        return True

    # --- context overhead: estimated from the first moment, measured once NVML can ---
    def _devices(self) -> dict[int, ctxest.Device]:
        """Each GPU's model and driver as NVML tells them (keys of what is learned)."""
        gpus = {}
        if self.nvml is not None and getattr(self.nvml, "ok", False):
            try:
                gpus = {g.index: g for g in self.nvml.gpus()}
            except Exception as e:
                log.warning("NVML cannot list the GPUs (%s): context estimates from --ctx-overhead", e)
        driver = getattr(self.nvml, "driver", "") or ""
        return {d: ctxest.Device(d, gpus[d].name, gpus[d].uuid, driver) if d in gpus else ctxest.Device(d)
                for d in self.capacity}

    def _choose(self, dev: int) -> ctxest.Estimate:
        return ctxest.choose(self.learned.get(self.devices[dev].key), self.devices[dev], self.ctx_overhead)

    def _ctx(self, dev: int) -> int:
        """Bytes charged per context on dev until NVML measures it."""
        e = self.est.get(dev)
        return e.bytes if e is not None else self.ctx_overhead

    def _measure_overhead(self) -> bool:
        """NVML's per-process memory beyond the bytes the probes track is each process's real
        context overhead (FACTS.md: ~519 MiB on the H100). BPF charges every context the
        device's estimate from its first moment; for each process NVML has measured, the
        container's extra_overhead replaces that estimate with the measurement (measured less
        contexts x estimate, negative where the estimate was high), so no context is charged
        both ways."""
        nv = self.sampler.take() if self.sampler is not None else None
        if nv is None:
            return False
        self.excess = nv
        for (pid, dev), (over, n) in nv.items():
            if n > 0 and dev in self.devices:
                self._peak[(pid, dev)] = max(self._peak.get((pid, dev), 0), over // n)
        return self._recharge()

    def _recharge(self, devs=None) -> bool:
        """box.extra from the last NVML sample and the estimates in force; written where changed."""
        changed = False
        for box in self.boxes.values():
            for dev in box.assigned:
                if devs is not None and dev not in devs:
                    continue
                est = self._ctx(dev)
                extra = sum(over - n * est for over, n in
                            (self.excess[(pid, dev)] for pid in box.pids if (pid, dev) in self.excess))
                if extra != box.extra.get(dev, 0) or devs is not None:
                    box.extra[dev] = extra
                    self._write_assign(box, dev)
                    changed = True
        return changed

    def _learn(self, pid: int):
        """A process leaves: what NVML measured for its contexts (at their largest) is learned
        for its device, and the device's estimate follows the new median."""
        for dev in sorted(d for p, d in self._peak if p == pid):
            per_ctx = self._peak.pop((pid, dev))
            self.learned.add(self.devices[dev].key, per_ctx)
            self._reestimate(dev)

    def _reestimate(self, dev: int):
        new = self._choose(dev)
        old = self.est.get(dev)
        if new == old:
            return
        self.est[dev] = new
        if old is None or new.bytes != old.bytes:
            log.info("GPU%d: a context is charged %s before NVML measures it (%s: %s)", dev,
                     format_size(new.bytes), new.source, new.detail)
            if self.tracer.b is not None:
                self._recharge({dev})   # extra is relative to the estimate: both change at once
                self._control(bool(self._leaf.get("enforcing")))

    def _save_learned(self, force: bool = False):
        now = time.monotonic()
        if self.learned.dirty and (force or now - self._learn_saved >= LEARN_SAVE_EVERY):
            self._learn_saved = now
            self.learned.save()

    def _tracked(self) -> dict[tuple[int, int], tuple[int, int]]:
        """(pid, dev) -> (live bytes, contexts) as the probes track them: NVML's excess over
        the bytes is the process's measured overhead, for that many contexts."""
        return {(u.pid, u.dev): (u.live, max(u.contexts, 0)) for u in self.tracer.usage()}

    # --- what `convgpu status`, metrics and trace show ---
    def status(self) -> dict:
        now = time.monotonic()
        gpus = {}
        for dev, cap in sorted(self.capacity.items()):
            assigned = self._assigned(dev)
            est = self.est.get(dev) or ctxest.Estimate(self.ctx_overhead, "ctx-overhead", "--ctx-overhead")
            gpus[str(dev)] = {"capacity": cap, "assigned": assigned, "unassigned": cap - assigned,
                              "physical": self.physical[dev], "tearing_down": self._tearing(dev),
                              "ctx_estimate": est.to_json()}
        rows = []
        for box in sorted(self.boxes.values(), key=lambda b: b.created):
            per = {}
            for dev in sorted(box.assigned):
                used, contexts, reserved = self._usage(box, dev)
                w = box.waiting.get(dev)
                per[str(dev)] = {
                    "assigned": box.assigned[dev], "used": used,
                    "context_overhead": self._ctx_held(box, dev, 0, contexts),
                    "context_source": self._ctx_source(box, dev, contexts),
                    "reserved": reserved, "contexts": contexts, "waiting": w is not None,
                    "shim_credit": self.broker.unspent(box, dev),
                    "over_limit": bool(w and w.over_limit),
                    "waiting_s": round(now - w.since, 3) if w else 0.0,
                    "waiting_pids": sorted(w.pids) if w else []}
            stalled = box.stalled_s + sum(now - w.since for w in box.waiting.values())
            rows.append({"id": box.container.id, "name": box.name, "kind": box.container.kind,
                         "cgroup": box.container.cgroup, "limit": box.limit, "source": box.source,
                         "pids": sorted(box.pids), "gpus": per, "stalled_s": round(stalled, 3),
                         "stalls": box.stalls, "grants": box.grants,
                         "over_limit_events": box.over_limits, "restalls": box.restalls})
        return {"pid": os.getpid(), "policy": self.policy, "over_limit": self.over_limit,
                "stall": "signal" if isinstance(self.stopper, SignalStopper) else "freezer",
                "ctx_overhead": self.ctx_overhead, "default_limit": self.rules.default,
                "started": self.started, "shim_asks": self.broker.asks, "gpus": gpus, "containers": rows,
                # allocations and contexts let through while the heartbeat had lapsed (BPF's count)
                "unchecked_calls": self.tracer.stats()["unchecked"], **self._discovery_status()}

    def _discovery_status(self) -> dict:
        d = getattr(self.tracer, "discovery", None)
        if d is None:   # --no-probes
            return {}
        return {"discovery": {"on": d.enabled, "stops": d.stops, "unprobed_policy": self.unprobed},
                "unprobed": [vars(u) for u in d.unprobed.values()]}


    def _ctx_source(self, box: Box, dev: int, contexts: int) -> str:
        """Where a container's context charge on dev comes from: NVML measured all of it, some
        of it (the rest: the device's estimate), or none yet."""
        if not contexts:
            return "none"
        measured = sum(self.excess[(p, dev)][1] for p in box.pids if (p, dev) in self.excess)
        if not measured:
            return self.est[dev].source if dev in self.est else "ctx-overhead"
        return "measured" if measured >= contexts else "measured+" + (self.est[dev].source if dev in self.est else "ctx-overhead")

    def snapshot(self, pids=None, container=None) -> dict:
        """`convgpu trace`'s view, with our state in it. A view turns alloc/free events on (from
        now: what came before was not kept) until VIEW_GRACE after its last snapshot."""
        was_quiet = self._quiet()
        self._viewed = time.monotonic()
        if was_quiet:
            self._control(True)
        snap = self.acct.snapshot(self.tracer.usage(), libraries=[str(x) for x in self.tracer.libraries],
                                  drops=self.tracer.stats()["drops"], pids=pids, container=container)
        d = snap.to_json()
        d["enforce"] = self.status()
        return {"snapshot": d, "events": [e.to_json() for e in self.acct.recent]}


def _answers(path: str) -> bool:
    try:
        server.request(path, {"cmd": "ping"}, timeout=2)
        return True
    except (OSError, ValueError):
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
