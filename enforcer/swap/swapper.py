"""Swap (issue 46; STYLE.md 21): a process's GPU memory moved to host memory by the driver's own
checkpoint, and back, as one part with a state machine you can read:

    running --lock--> locking --ok--> checkpointing --ok--> out
    out --(a wait for its whole footprint, granted by the policy)--> restoring --ok--> unlocking --ok--> running

A process is out when the driver holds nothing of it on the GPU: its container is credited what
it was charged there (books.swapped: Books.beyond takes it off, BPF's admission with it), so its
assignment may go to others. Its next driver call blocks in the driver (it is locked); the
probes hear it (an admitted call is stopped as over its charge; any other call meets bpf/swap.bpf.c
`touch`, attached while anyone is out), and that call is a wait for its whole footprint, granted
by the policy like any wait; `convgpu swap in` and, with --swap-in eager, room freeing make the
same wait. Every failed step goes back to the last safe state and says why:
- a lock that fails (its timeout with work in flight; a process the driver cannot lock) or gets
  no answer: unlocked (harmless if it never locked), running;
- a checkpoint that fails: unlocked, running;
- a restore is never started without the room: the grant holds it in the books and NVML must
  show the bytes free on the GPU (driver 580 left a process it could not restore for want of
  room beyond saving: FACTS.md). One the driver refuses anyway: killed (on driver 580 it never
  runs again, whatever state the driver reports), said and shown; one with no answer: out
  again, retried when room frees;
- an unlock that fails: said, shown; the watchdog retries it if we die.
The driver calls are made by a child (agent.py, through client.Agent), never by the enforcer.
What is out or in between is kept in the state dir (swap.json, before each step goes out):
a successor finds it (load), and the watchdog's release leaves nothing locked if none comes."""
import fnmatch
import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

from ...units import format_size
from ..books import Ask, Wait
from . import idle
from .procfs import cgroup_room, cpu_of, start_of, stop_release

log = logging.getLogger("convgpu.enforcer.daemon")   # the Enforcer logs as one
LOCK_MS = 10000         # the driver's lock timeout: a process with work in flight longer fails the swap
SLOW = 0.5 * 2 ** 30    # B/s the deadlines assume for a copy (measured: ~1.3 GiB/s out, ~4.5 GiB/s in, H100)
MARGIN = 256 << 20      # NVML's free memory must exceed a restore's bytes by this
NEVER = "convgpu.io/swap"   # a label (or pod annotation) with the value "never": never swapped
SAMPLE_S = 1.0          # s between idleness samples
FOR_OTHERS_S = 30.0     # s at most a side swapped out of a deadlock waits behind the others


@dataclass
class Swap:
    pid: int
    start: int
    cid: str
    name: str
    state: str                                        # locking checkpointing out restoring unlocking failed checking
    nvml: dict[int, int]                              # GPU -> NVML's bytes for it when it went (what moves)
    credit: dict[int, int] = field(default_factory=dict)   # GPU -> what its container was charged for it
    since: float = 0.0                                # when it went out (time.time())
    why: str = ""
    asked: bool = False                               # a wait for its footprint is in the books
    retry: int = -1                                   # NVML's sample (seq) a refused restore waits to be past


@dataclass
class Settings:
    idle_s: float = 0.0       # --swap-idle: holders quiet this long may be swapped for a waiter (0: never)
    eager: bool = False       # --swap-in eager: back as soon as room frees, not at its next call
    budget: int | None = None  # --swap-budget: host memory all swapped processes may take
    never: tuple = ()         # name globs never swapped (config `never_swap`)


class Swapper:
    """Handed the books (it credits swapped processes there and makes their waits), BpfMaps
    (assignments, the `swapped` map), the tracer (its usage, the touch probes), the agent (or
    None), its settings, process_holds(box, dev) (what each process holds), whole(pid) (a stop
    holds every thread of it: it cannot run for the driver), nvml() (the sampler: per-process
    bytes, GPU totals), gpu_total(dev), changed() (room came or went), kill(pid) (a process the
    driver cannot bring back), the state file's path."""

    def __init__(self, books, maps, tracer, agent, settings: Settings, process_holds, whole, nvml, gpu_total,
                 changed, kill, path: str | None):
        self.books, self.maps, self.tracer, self.agent, self.settings = books, maps, tracer, agent, settings
        self.process_holds, self.whole, self.nvml, self.gpu_total = process_holds, whole, nvml, gpu_total
        self.changed, self.kill, self.path = changed, kill, path
        self.procs: dict[int, Swap] = {}
        # container id -> (GPU, the containers it went out for, until when): a side swapped out to
        # break a deadlock gets no grant there before them (a first-come policy handed the room
        # it freed straight back to it: it had waited longest)
        self.for_others: dict[str, tuple[int, set[str], float]] = {}
        self.off = ""                    # why swap cannot be (no host driver; the agent's answer)
        self.seen: dict[int, idle.Activity] = {}
        self._sampled = 0.0
        self.swaps = self.restores = 0

    # ---- what others ask ----
    def out(self, pid: int, why: str) -> str:
        """Start swapping pid out; "" if started, else why not."""
        box = self.books.pid_box.get(pid)
        why_not = self.why_not(pid, box)
        if why_not:
            return why_not
        rows = {d: n for (p, d), n in (self.nvml().raw if self.nvml() else {}).items() if p == pid and n > 0}
        rows = rows or {d: h[0] for d in box.assigned if (h := self.process_holds(box, d).get(pid)) and h[0] > 0}
        if not rows:
            return f"pid {pid} holds no GPU memory"
        budget = self.settings.budget
        if budget is not None and self.host_bytes() + sum(rows.values()) > budget:
            return (f"the swap budget {format_size(budget)} would be passed ({format_size(self.host_bytes())} out, "
                    f"{format_size(sum(rows.values()))} more)")
        room = cgroup_room(pid)
        if room is not None and room < sum(rows.values()):
            return (f"its memory cgroup has {format_size(room)} left below its limit, and the driver would put "
                    f"{format_size(sum(rows.values()))} of host copy there")
        self.procs[pid] = Swap(pid, start_of(pid), box.container.id, box.name, "locking", rows, why=why)
        self._save()
        self.tracer.touch(True)   # before the lock: its first call once locked is heard
        self.agent.submit("lock", pid, LOCK_MS / 1000 + 10, LOCK_MS)
        log.info("swap out %s pid %d (%s): %s on GPU%s, locking", box.name, pid, why,
                 format_size(sum(rows.values())), ",".join(map(str, sorted(rows))))
        return ""

    def why_not(self, pid: int, box) -> str:
        if box is None:
            return f"pid {pid} is not a CUDA process convgpu placed"
        why_off = self.why_off()
        if why_off:
            return f"swap is off: {why_off}"
        if pid in self.procs:
            return f"pid {pid} is {self.procs[pid].state} already"
        if dict(box.labels or {}).get(NEVER) == "never" or any(fnmatch.fnmatchcase(box.name, g) for g in self.settings.never):
            return f"container {box.name} is marked not swappable"
        if self.whole(pid) and any(a.pid == pid for w in box.waiting.values() for a in w.asks.values()) \
                or self.books.freezer and box.waiting:
            return (f"pid {pid} is stopped whole at a call (the freezer, or one it holds whole): the driver "
                    "cannot lock a process that cannot run")
        return ""

    def want(self, pid: int, why: str):
        """A swapped process wants to run (its next call, `swap in`, room with --swap-in eager):
        a wait for its whole footprint on each GPU, granted by the policy like any wait."""
        s = self.procs.get(pid)
        box = self.books.pid_box.get(pid)
        if s is None or s.state != "out" or s.asked or box is None:
            return
        s.asked = True
        now = time.monotonic()
        for dev, n in s.credit.items():
            w = box.waiting.get(dev)
            if w is None:
                w = box.waiting[dev] = Wait(now, set(), freed_at=now, held_was=self.books.taken(box, dev))
                box.stalls += 1
            w.asks[-pid] = Ask(pid, -pid, n, now, swapin=True)
            w.pids.add(pid)
        log.info("swap in %s pid %d wanted (%s): waits for %s", box.name, pid, why, format_size(sum(s.credit.values())))
        self.changed()

    def resume(self, box, dev: int, ask: Ask):
        """The policy granted a swap-in wait (Actuator): restore, once NVML shows the room."""
        s = self.procs.get(ask.pid)
        if s is None or s.state != "out":
            return
        free = self.gpu_total(dev) - (self.nvml().used.get(dev, 0) if self.nvml() else 0)
        need = sum(s.nvml.values())
        if self.nvml() is not None and free < need + MARGIN:
            if s.retry < 0:   # said once a wait; the grant came, the room not (an exit NVML still lists)
                log.warning("swap in %s pid %d: NVML shows %s free on GPU%d, %s needed: not restored yet (a "
                            "restore without the room leaves it beyond saving); it waits again", s.name, s.pid,
                            format_size(free), dev, format_size(need))
            s.asked, s.retry = False, self.nvml().seq   # asked again at a later sample (step): never from here,
            return                                      # inside the decider's pass
        self._credit(s, -1)   # its room is its container's again: held for the restore in the books
        s.state, s.retry = "restoring", -1
        self._save()
        self.agent.submit("restore", s.pid, need / SLOW + 60)

    def gone(self, pid: int):
        """It exited: its host copy went with it."""
        s = self.procs.pop(pid, None)
        if s is None:
            return
        if s.state == "out":
            self._credit(s, -1)
        self._untrack(s)

    # ---- the loop's ----
    def step(self, now: float):
        if self.agent is not None:
            for r in self.agent.results():
                self._answer(r)
        if now - self._sampled >= SAMPLE_S:
            self._sampled = now
            self._sample(now)
            nv = self.nvml()
            for s in list(self.procs.values()):   # a restore refused for want of room NVML showed: again
                if s.state == "out" and not s.asked and s.retry >= 0 and nv is not None and nv.seq > s.retry:
                    self.want(s.pid, "NVML sampled again")
            if self.settings.eager:
                for s in list(self.procs.values()):
                    if s.state == "out" and not s.asked and all(self.books.free(d) >= n for d, n in s.credit.items()):
                        self.want(s.pid, "room freed (--swap-in eager)")

    def _answer(self, r):
        s = self.procs.get(r.pid)
        if s is None:
            return
        ok = r.rc == 0
        said = f"CUresult {r.rc}" if r.rc is not None else r.why
        if s.state == "checking":   # one the enforcer before us left in between (load)
            if r.state == 2:
                s.state, s.since = "out", s.since or time.time()
                self._credit(s, +1)
                self.maps.set_swapped(s.pid, True)
                self.tracer.touch(True)
                self._save()
            elif r.state == 1:
                s.state = "unlocking"
                self.agent.submit("unlock", s.pid, 30)
            elif r.state == 3:
                self._lost(s, "the driver left it failed")
            else:
                self._back(s)
            return
        if s.state == "locking":
            if ok:
                s.state = "checkpointing"
                self._save()
                self.agent.submit("checkpoint", s.pid, sum(s.nvml.values()) / SLOW + 60)
                return
            log.warning("swap out %s pid %d failed: the driver could not lock it (%s); it runs on", s.name, s.pid, said)
            return self._back(s, unlock=True)
        if s.state == "checkpointing":
            if not ok:
                log.warning("swap out %s pid %d failed: checkpoint %s; unlocked, it runs on", s.name, s.pid, said)
                return self._back(s, unlock=True)
            s.state, s.since = "out", time.time()
            box = self.books.pid_box.get(s.pid)
            s.credit = {d: h[0] for d in s.nvml if box and (h := self.process_holds(box, d).get(s.pid))}
            self._credit(s, +1)
            self.maps.set_swapped(s.pid, True)
            self.swaps += 1
            self._save()
            log.info("swap out %s pid %d: done in %.2f s, %s in host memory", s.name, s.pid, r.s,
                     format_size(sum(s.nvml.values())))
            if box is not None:
                for d, n in s.credit.items():   # its assignment there may go to others
                    if d in box.assigned:
                        box.assigned[d] = max(self.books.held(box, d), box.assigned[d] - n)
                        self.maps.write_assign(box, d)
                if box.waiting:   # it waited before it went out (a deadlock broken): it still wants to run
                    self.want(s.pid, "it was waiting")
            self.changed()
            return
        if s.state == "restoring":
            if ok:
                s.state = "unlocking"
                self._save()
                self.agent.submit("unlock", s.pid, 30)
                return
            if r.rc is not None:   # the driver answered no: on driver 580 that process never runs again
                return self._lost(s, f"restore: {said}")
            log.warning("swap in %s pid %d: restore %s; stays in host memory, retried when room frees", s.name,
                        s.pid, said)
            s.state, s.asked = "out", False
            self._credit(s, +1)
            self._save()
            self.changed()
            return
        if s.state == "unlocking":
            if ok:
                self.restores += 1
                log.info("swap in %s pid %d: back on the GPU after %.1f s out", s.name, s.pid, time.time() - s.since)
                return self._back(s)
            s.state, s.why = "failed", f"unlock: {said}"
            log.error("swap in %s pid %d: %s: it stays locked (the watchdog unlocks it if we die)", s.name, s.pid, s.why)
            self._save()

    def _lost(self, s: Swap, why: str):
        """A restore the driver refused: on driver 580 the process is beyond saving whatever state
        it reports (a restore that lacked the room left it CHECKPOINTED, then 304, unlock 401, and
        it never answered again: FACTS.md). Killed, so that its job fails where it would hang."""
        s.state, s.why = "failed", why
        if start_of(s.pid) == s.start:   # the same process, not a reused pid
            self.kill(s.pid)
            s.why += ": killed"
        log.error("swap in %s pid %d: %s (the driver cannot bring it back: killed, its job fails instead of "
                  "hanging)", s.name, s.pid, why)
        self._save()

    def _back(self, s: Swap, unlock: bool = False):
        """Running again (or never gone): untracked; an unlock sent where it may be locked."""
        if unlock:
            self.agent.submit("unlock", s.pid, 30)
        self.procs.pop(s.pid, None)
        self._untrack(s)
        self.changed()

    def _untrack(self, s: Swap):
        self.maps.set_swapped(s.pid, False)
        self.books.swapped_pids.discard(s.pid)
        if not any(x.state == "out" for x in self.procs.values()):
            self.tracer.touch(False)
        self._save()

    def _credit(self, s: Swap, sign: int):
        per = self.books.swapped.setdefault(s.cid, {})
        for d, n in s.credit.items():
            per[d] = per.get(d, 0) + sign * n
            if per[d] <= 0:
                del per[d]
        if not per:
            self.books.swapped.pop(s.cid, None)
        (self.books.swapped_pids.add if sign > 0 else self.books.swapped_pids.discard)(s.pid)
        box = self.books.pid_box.get(s.pid)
        for d in s.credit:
            if box is not None and d in box.assigned:
                self.maps.write_assign(box, d)

    # ---- the policies' (issue 46 part 2) ----
    def holders(self, dev: int, now: float) -> list[idle.Holder]:
        """Processes holding memory on dev, with how long each was quiet and why it may not go."""
        out = []
        raw = self.nvml().raw if self.nvml() else {}
        for pid, box in self.books.pid_box.items():
            n = raw.get((pid, dev), 0) or (self.process_holds(box, dev).get(pid, (0, 0))[0] if dev in box.assigned else 0)
            if n <= 0:
                continue
            a = self.seen.get(pid)
            out.append(idle.Holder(pid, box.container.id, n, now - a.quiet_since if a else 0.0, self.why_not(pid, box)))
        return out

    def make_room(self, dev: int, need: int, now: float) -> bool:
        """--swap-idle: a waiter lacks `need` on a full GPU. Holders quiet for the setting's
        seconds, of containers that do not wait themselves, go out, idle longest first."""
        if not self.settings.idle_s or need <= 0:
            return False
        if any(s.state in ("locking", "checkpointing") for s in self.procs.values()):
            return True   # room on its way
        waiting = {b.container.id for b in self.books.boxes.values() if b.waiting}
        hs = [h for h in self.holders(dev, now) if h.container not in waiting]
        chosen = idle.victims(hs, need, self.settings.idle_s)
        for h in chosen:
            self.out(h.pid, f"idle {h.idle_s:.0f} s, room for a waiter on GPU{dev}")
        return bool(chosen)

    def break_deadlock(self, dev: int, needs: dict[str, int], now: float) -> bool:
        """A circular wait (every container on dev waits, none can run): one side goes out, no
        kill (docs/SCHEDULING.md, "A deadlock swapped out"); with --swap-idle, as all swapping
        by policy."""
        if not self.settings.idle_s:
            return False
        if any(s.state in ("locking", "checkpointing") for s in self.procs.values()):
            return True
        hs = [h for h in self.holders(dev, now) if h.container in needs]
        chosen = idle.breaker(hs, needs)
        for h in chosen:
            self.out(h.pid, f"GPU{dev} deadlocked: out so that another waiter can run")
        if chosen:
            self.for_others[chosen[0].container] = (dev, set(needs) - {chosen[0].container}, now + FOR_OTHERS_S)
        return bool(chosen)

    def behind(self, box, dev: int) -> bool:
        """box went out to break a deadlock on dev: no grant for it there while those it went out
        for still wait (at most FOR_OTHERS_S)."""
        cid = box.container.id
        got = self.for_others.get(cid)
        if got is None or got[0] != dev:
            return False
        waiting = {b.container.id for b in self.books.boxes.values() if dev in b.waiting}
        if got[1] & waiting and time.monotonic() < got[2]:
            return True
        del self.for_others[cid]
        return False

    def _sample(self, now: float):
        counts: dict[int, int] = {}
        for u in self.tracer.usage():
            counts[u.pid] = counts.get(u.pid, 0) + u.n_alloc + u.n_free + max(u.contexts, 0)
        waiting = {a.pid for b in self.books.boxes.values() for w in b.waiting.values() for a in w.asks.values()}
        for pid in list(self.books.pid_box):   # a process that waits is quiet because it must be: never idle
            self.seen[pid] = idle.observe(self.seen.get(pid), counts.get(pid, 0), cpu_of(pid), pid in waiting, now)
        for pid in set(self.seen) - set(self.books.pid_box):
            del self.seen[pid]

    def why_off(self) -> str:
        return self.off or (self.agent.off if self.agent is not None else "not started")

    def release_argv(self) -> list[str] | None:
        """How the watchdog (or close) leaves nothing locked when we are gone (agent.py --release)."""
        if self.agent is None or not self.path:
            return None
        return [sys.executable, "-m", "convgpu.enforcer.swap.agent", self.agent.driver, "--release", self.path]

    def close(self, hand_over: bool = False):
        """A stop: the agent goes. What is out or in between stays in swap.json: the successor
        takes it (hand_over), else a release agent of its own session brings each back once it
        fits (no process is left locked with nobody to unlock it)."""
        if self.agent is None:
            return
        self.agent.close()
        if self.procs and not hand_over and (argv := self.release_argv()):
            subprocess.Popen(argv, start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             cwd="/")
            log.info("swap: %d processes out or in between at the stop: a release agent brings them back as "
                     "room frees", len(self.procs))

    # ---- what is shown and kept ----
    def host_bytes(self) -> int:
        return sum(sum(s.nvml.values()) for s in self.procs.values() if s.state != "locking")

    def status(self, box, dev: int) -> dict:
        mine = [s for s in self.procs.values() if s.cid == box.container.id and dev in s.nvml]
        out = [s for s in mine if s.state == "out"]
        return {"swapped": sum(s.nvml[dev] for s in out),
                "swapped_s": round(max((time.time() - s.since for s in out), default=0.0), 3),
                "swaps": [{"pid": s.pid, "state": s.state, "bytes": s.nvml[dev], "why": s.why} for s in mine]}

    def _save(self):
        """swap.json: what is out or in between, for a successor and the watchdog's release."""
        if not self.path:
            return
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump({"procs": {str(p): {**asdict(s), "bytes": {str(d): n for d, n in s.nvml.items()}}
                                 for p, s in self.procs.items()}}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def load(self):
        """At a start: what an enforcer before us left out or in between (its processes still
        the same: pid and start time), taken back as ours; the driver says where each stands."""
        stop_release(f"{self.path}.pid")   # a release agent of the one before us: ours from now
        try:
            with open(self.path) as f:
                kept = json.load(f).get("procs", {})
        except (OSError, ValueError, TypeError):
            return
        for rec in kept.values():
            try:
                s = Swap(**{k: v for k, v in rec.items() if k in Swap.__dataclass_fields__})
                s.nvml = {int(d): n for d, n in s.nvml.items()}
                s.credit = {int(d): n for d, n in s.credit.items()}
            except TypeError:
                continue
            if start_of(s.pid) != s.start or s.pid not in self.books.pid_box or self.agent is None:
                continue
            s.asked = False
            self.procs[s.pid] = s
            if s.state == "out":
                self._credit(s, +1)
                self.maps.set_swapped(s.pid, True)
                self.tracer.touch(True)
                log.info("swap: pid %d of %s was out when the enforcer before us stopped: still out", s.pid, s.name)
            else:   # in between: where the driver left it decides
                s.state = "checking"
                self.agent.submit("state", s.pid, 30)
        self._save()
