"""`convgpu enforce`: per-container GPU-memory limits, enforced by stalling (ConVGPU III-D/E).

BPF admits or stops each call before it runs (bpf/convgpu.bpf.c, "enforce"); this loop
places new processes in containers, assigns memory, and resumes waiters as the policy grants
memory. Every decision is one log line. The BPF side fails open when the heartbeat stops."""
import ctypes as ct
import fcntl
import logging
import os
import random
import resource
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from ..units import format_size
from . import policies
from .containers import Container, container_of_pid
from .limits import LimitRules
from .stall import SignalStopper, Target
from . import watchdog
from .watchdog import write_state

log = logging.getLogger(__name__)
HEARTBEAT_EVERY = 0.25   # s; BPF stops admitting (fails open) after 2 s without one


@dataclass
class Wait:
    since: float
    pids: set[int]
    unreserved: int = 0      # requests stopped before placement: not reserved in BPF
    over_limit: bool = False


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


class Enforcer:
    def __init__(self, tracer, policy: str, capacity: dict[int, int], rules: LimitRules,
                 stopper=None, over_limit: str = "stall", ctx_overhead: int = 0,
                 max_wait: float = 30.0, seed: int | None = None, engines=None,
                 container_of=container_of_pid, state_dir: str = "/run/convgpu"):
        policies.POLICIES[policy]   # validated by the CLI; KeyError here is a bug
        self.tracer, self.policy, self.capacity, self.rules = tracer, policy, capacity, rules
        self.stopper = stopper or SignalStopper()
        self.over_limit, self.ctx_overhead, self.max_wait = over_limit, ctx_overhead, max_wait
        self.rng = random.Random(seed)
        self.engines = engines
        self.container_of = container_of
        self.boxes: dict[str, Box] = {}
        self.by_key: dict[int, Box] = {}
        self.pid_box: dict[int, Box] = {}
        self._next_key = 1
        self._beat = 0.0
        self._paused = False
        self.state_dir = state_dir
        self.state_file = os.path.join(state_dir, f"held-{os.getpid()}.json")
        self.watchdog = None

    # --- BPF maps ---
    def _t(self, name):
        return self.tracer.b[name.encode()]

    def _control(self, enforcing: bool):
        t = self._t("control")
        t[ct.c_int(0)] = t.Leaf(heartbeat_ns=time.monotonic_ns(), ctx_overhead=self.ctx_overhead,
                                enforcing=int(enforcing and not self._paused),
                                over_limit_kill=int(self.over_limit == "kill"))

    def _write_assign(self, box: Box, dev: int):
        t = self._t("assign")
        t[t.Key(container=box.key, dev=dev)] = t.Leaf(limit=box.limit, assigned=box.assigned[dev],
                                                      extra_overhead=0)

    def _state(self, box: Box, dev: int):
        t = self._t("cgstate")
        try:
            return t[t.Key(container=box.key, dev=dev)]
        except KeyError:
            return None

    # --- life cycle ---
    def start(self) -> "Enforcer":
        self.tracer.selftest_guard = self._pause
        self.tracer.start()
        os.makedirs(self.state_dir, mode=0o700, exist_ok=True)
        write_state(self.state_file, [], [])
        # The watchdog (enforcer/watchdog.py) learns of our death from a pipe. At exit the kernel closes descriptors in ascending order and runs the releases in
        # reverse, so the highest descriptor is released first, ahead of the perf events
        # whose uprobe detach costs ~100 ms each.
        r, w = os.pipe()
        ctl = self._t("control").map_fd
        top = resource.getrlimit(resource.RLIMIT_NOFILE)[0] - 1
        self._lifeline = fcntl.fcntl(w, fcntl.F_DUPFD_CLOEXEC, max(top - 16, w))
        os.close(w)
        # its own session: a kill of our process group must not take the fail-safe with it;
        # it gets the control map to turn admission off the moment we die
        self.watchdog = subprocess.Popen([sys.executable, watchdog.__file__,   # stdlib only
                                          str(os.getpid()), self.state_file, str(r), str(ctl)],
                                         start_new_session=True, pass_fds=(r, ctl))
        os.close(r)
        self._control(True)
        log.info("enforcing: policy %s, capacity %s", self.policy,
                 ", ".join(f"GPU{d} {format_size(c)}" for d, c in sorted(self.capacity.items())))
        return self

    def _pause(self):
        """Admission off while a self-test child calls every driver symbol (else it stalls)."""
        enf = self

        class _Guard:
            def __enter__(self):
                enf._paused = True
                enf._control(True)

            def __exit__(self, *exc):
                enf._paused = False
                enf._control(True)
        return _Guard()

    def close(self):
        """Nothing stays stopped: every waiter is resumed, admission is turned off."""
        if self.tracer.b is not None:
            self._control(False)
        for box in self.boxes.values():
            for dev in list(box.waiting):
                self._resume(box, dev, "enforcer stopping")
        self.tracer.close()
        if self.watchdog is not None:   # nothing is held now: it has nothing left to do
            self.watchdog.kill()
            self.watchdog.wait()
            try:
                os.unlink(self.state_file)
            except OSError:
                pass

    def _save_held(self):
        """What the watchdog must undo if we die: every waiting pid, every frozen cgroup."""
        pids, cgroups = set(), set()
        for box in self.boxes.values():
            for w in box.waiting.values():
                pids |= w.pids
                if not isinstance(self.stopper, SignalStopper):
                    pids |= box.pids
                    cgroups.add(self.stopper.root.rstrip("/") + box.container.cgroup)
        write_state(self.state_file, pids, cgroups)

    # --- the loop ---
    def step(self):
        now = time.monotonic()
        if now - self._beat >= HEARTBEAT_EVERY:
            self._control(True)
            self._beat = now
        events = self.tracer.poll()
        dirty = False
        for e in events:
            if e.op == "unknown":
                self._place(e.pid, max(e.dev, 0), e.size)
                dirty = True
            elif e.op in ("stall", "over_limit"):
                box = self.by_key.get(e.addr)
                if box is not None:
                    log.info("stall %s pid %d on GPU%d: %s %s would bring it to %s (assigned %s)",
                             box.name, e.pid, max(e.dev, 0), e.api, format_size(e.size),
                             format_size(e.live), format_size(box.assigned.get(max(e.dev, 0), 0)))
                    self._waiter(box, max(e.dev, 0), e.pid, 0)   # schedule() tells over-limit
                dirty = True
            elif e.op in ("free", "exit", "exec", "ctx_destroy"):
                if e.op in ("exit", "exec"):
                    self._gone(e.pid)
                dirty = True
        if dirty:
            self.schedule()
            self._save_held()
        return events

    def run(self, duration: float = 0.0, tick: float = 0.02, on_step=None):
        end = time.monotonic() + duration if duration else None
        while end is None or time.monotonic() < end:
            events = self.step()
            if on_step:
                on_step(events)
            time.sleep(tick)

    # --- placement ---
    def _box_for(self, pid: int) -> Box | None:
        try:
            c = self.container_of(pid)
        except Exception:
            return None
        box = self.boxes.get(c.id)
        if box is None:
            meta = self.engines.lookup_sync(c) if self.engines is not None else None
            name = meta.name if meta and meta.name else c.short
            limit, source = self.rules.limit_for(c, name, meta.labels if meta else None)
            cap = max(self.capacity.values())
            if limit > cap:
                log.warning("container %s: limit %s above capacity %s: capped", name,
                            format_size(limit), format_size(cap))
                limit = cap
            box = Box(self._next_key, c, name, time.monotonic(), limit, source)
            self._next_key += 1
            self.boxes[c.id] = box
            self.by_key[box.key] = box
            log.info("container %s (%s): limit %s from %s", name, c.kind, format_size(limit), source)
        return box

    def _place(self, pid: int, dev: int, request: int):
        box = self._box_for(pid)
        if box is None:     # gone before we could place it: nothing to hold
            os.kill(pid, signal.SIGCONT) if _alive(pid) else None
            return
        self._t("members")[ct.c_uint(pid)] = ct.c_ulonglong(box.key)
        box.pids.add(pid)
        self.pid_box[pid] = box
        if dev not in box.assigned:
            self._new_device(box, dev)
        self._waiter(box, dev, pid, request)

    def _new_device(self, box: Box, dev: int):
        """First context of a container on a device: A_c = min(L_c, unassigned)."""
        free = self.capacity.get(dev, 0) - sum(b.assigned.get(dev, 0) for b in self.boxes.values())
        box.assigned[dev] = policies.assign_new(box.limit, free)
        st = self._t("cgstate")
        st[st.Key(container=box.key, dev=dev)] = st.Leaf()
        self._write_assign(box, dev)
        log.info("container %s GPU%d: assigned %s (limit %s)", box.name, dev,
                 format_size(box.assigned[dev]), format_size(box.limit))

    def _waiter(self, box: Box, dev: int, pid: int, unreserved: int):
        w = box.waiting.get(dev)
        if w is None:
            w = box.waiting[dev] = Wait(time.monotonic(), set())
            box.stalls += 1
        w.pids.add(pid)
        w.unreserved += unreserved
        if isinstance(self.stopper, SignalStopper):
            return
        # freezer mode: hold the whole container in its cgroup, then drop the signal stop,
        # so that no SIGCONT from inside the container can undo the stall
        try:
            self.stopper.stall(Target(tuple(box.pids), box.container.cgroup))
            for p in box.pids:
                os.kill(p, signal.SIGCONT) if _alive(p) else None
        except Exception as e:
            log.warning("container %s: freezer failed (%s); it stays signal-stopped", box.name, e)

    def _gone(self, pid: int):
        box = self.pid_box.pop(pid, None)
        if box is None:
            return
        box.pids.discard(pid)
        for dev, w in list(box.waiting.items()):
            w.pids.discard(pid)
            if not w.pids:
                del box.waiting[dev]
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
    def _demand(self, box: Box, dev: int) -> int:
        """U_c plus what is pending: everything the container needs to run on."""
        s = self._state(box, dev)
        if s is None:
            return 0
        w = box.waiting.get(dev)
        return (s.used + max(s.contexts, 0) * self.ctx_overhead + s.reserved
                + (w.unreserved if w else 0))

    def schedule(self):
        now = time.monotonic()
        for dev in sorted(self.capacity):
            waiting = [b for b in self.boxes.values() if dev in b.waiting]
            for box in waiting:   # a free inside the container may be enough
                if self._demand(box, dev) <= box.assigned[dev]:
                    self._resume(box, dev, "fits its assignment")
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
                                             assigned=box.assigned[dev], used=demand, request=0))
            free = self.capacity[dev] - sum(b.assigned.get(dev, 0) for b in self.boxes.values())
            for g in policies.schedule(self.policy, cands, free, now, self.rng, self.max_wait):
                box = self.boxes[g.id]
                box.assigned[dev] += g.amount
                box.grants += 1
                self._write_assign(box, dev)
                log.info("grant %s to %s on GPU%d (assigned %s)", format_size(g.amount), box.name,
                         dev, format_size(box.assigned[dev]))
                if g.resume:
                    self._resume(box, dev, f"policy {self.policy}")

    def _over_limit(self, box: Box, dev: int, demand: int):
        w = box.waiting[dev]
        if not w.over_limit:
            w.over_limit = True
            log.warning("container %s GPU%d: needs %s, above its limit %s: %s", box.name, dev,
                        format_size(demand), format_size(box.limit),
                        "killing it" if self.over_limit == "kill" else "stalled until the limit is raised")
        if self.over_limit == "kill":
            for p in list(w.pids):
                os.kill(p, signal.SIGKILL) if _alive(p) else None

    def _resume(self, box: Box, dev: int, why: str):
        w = box.waiting.pop(dev, None)
        if w is None:
            return
        box.stalled_s += time.monotonic() - w.since
        if isinstance(self.stopper, SignalStopper):
            self.stopper.resume(Target(tuple(w.pids)))
        else:
            self.stopper.resume(Target(tuple(box.pids), box.container.cgroup))
            self._signal(box.pids, signal.SIGCONT)
        log.info("resume %s on GPU%d after %.3f s (%s)", box.name, dev, time.monotonic() - w.since, why)

    @staticmethod
    def _signal(pids, sig):
        for p in pids:
            if _alive(p):
                os.kill(p, sig)

    def set_limit(self, container: str, limit: int) -> Box:
        """Change a limit at run time; an over-limit waiter may now fit."""
        for box in self.boxes.values():
            if container in (box.name, box.container.id, box.container.short):
                box.limit = limit
                for dev in box.assigned:
                    self._write_assign(box, dev)
                    if dev in box.waiting:
                        box.waiting[dev].over_limit = False
                log.info("limit of %s set to %s", box.name, format_size(limit))
                self.schedule()
                return box
        raise KeyError(container)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
