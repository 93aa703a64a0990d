"""Taking over: load the BPF program over the maps a previous enforcer left pinned (its
watchdog kept them exact) and adopt its containers, assignments and counters."""
import logging
import os
import time

from ...probes.events import EF_ORDINAL, EF_RESERVED, Event
from ...probes.table import API_NAMES
from ...units import format_size
from . import takeover
from ..actuator import alive
from ..books import Box
from ..tenants.containers import Container

log = logging.getLogger("convgpu.enforcer.daemon")   # the Enforcer logs as one: "daemon: ..." (bench/sched, tests read it)


def _state(pid: int, tid: int) -> str:
    try:
        with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return ""


class Adopter:
    """The start after a crashed or replaced enforcer. Handed the tracer (loaded over the pins),
    BpfMaps (the pinned maps as they are), the books (the containers it adopts), Runtime (their
    names and limits), ctx_of(dev) (what a context is charged now), container_of(pid), and where
    things are: the run dir, our own state file, the pin dir, and our owner number."""

    def __init__(self, tracer, maps, books, runtime, ctx_of, container_of, run_dir: str, state_file: str,
                 pin_dir: str, owner: int):
        self.tracer, self.maps, self.books, self.runtime, self.ctx_of = tracer, maps, books, runtime, ctx_of
        self.container_of, self.run_dir, self.state_file, self.pin_dir, self.owner = (container_of, run_dir,
                                                                                       state_file, pin_dir, owner)

    def load_over_pins(self) -> list[dict]:
        """Load the BPF program over the maps a crashed enforcer left pinned (and its watchdog
        kept exact), or over fresh ones."""
        prev = takeover.previous(self.run_dir, self.state_file)
        self.tracer.owner = self.owner   # admission checks who owns it (BPF's config map)
        if not takeover.ensure_bpffs():
            self.tracer.start()
            return []
        if not prev:
            takeover.clear(self.pin_dir)   # no successor-to-be left them: stale
        os.makedirs(self.pin_dir, mode=0o700, exist_ok=True)
        self.tracer.cflags = (*(f for f in self.tracer.cflags if not f.startswith("-DPIN_DIR=")),   # its own stay
                              f'-DPIN_DIR="{self.pin_dir}"')
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

    def adopt(self, prev: list[dict]):
        """Containers, assignments and counters of the enforcer before us, from the pinned
        maps (exact) and its state file (names, ages, counters)."""
        if not prev:
            return
        info = {}
        for st in prev:
            info.update(st.get("boxes", {}))
        books = self.books
        pids = self.maps.live_members(alive)
        self.maps.prune(set(pids))   # containers gone meanwhile (their map quota buckets too: enforcer/quotas.py)
        charge = {}   # (container, dev) -> the per-context charge the old enforcer wrote
        for k, a in self.maps.assignments():
            box = books.by_key.get(k.container)
            if box is None:
                box = self._rebuild(k.container, pids.get(k.container, set()), info.get(str(k.container), {}))
                if box is None:
                    continue
            box.assigned[k.dev] = a.assigned
            box.extra[k.dev] = a.extra_overhead
            box.adopted[k.dev] = (a.adopted, a.adopted_contexts)
            st = books.state_of(box, k.dev)   # exits the old enforcer saw no pidfd of: freed by now
            box.torn[k.dev] = st.tearing if st is not None else a.torn
            charge[(box.key, k.dev)] = a.ctx_charge
        for box in books.boxes.values():
            for dev in box.assigned:
                # its extra was relative to the old per-context charge (our estimate may differ,
                # e.g. a measurement at start that came in meanwhile): keep the container's total as it was
                _, contexts, _ = books.usage(box, dev)
                box.extra[dev] += contexts * (charge.get((box.key, dev), self.ctx_of(dev)) - self.ctx_of(dev))
                self.maps.write_assign(box, dev)
        books.next_key = max(books.by_key, default=0) + 1
        log.info("took over from enforcer %s: %d containers, %s assigned",
                 ", ".join(os.path.basename(st["path"])[5:-5] for st in prev), len(books.boxes),
                 format_size(sum(sum(b.assigned.values()) for b in books.boxes.values())))

    def _rebuild(self, key: int, pids: set[int], old: dict) -> Box | None:
        """The budget of a key the enforcer before us kept, from its processes' containers (the
        same budget Placement would choose: Runtime.budget) and its state file's names and
        counters; None if none of its processes can be looked at."""
        books, runtime = self.books, self.runtime
        of = {}
        for p in sorted(pids):
            try:
                of[p] = self.container_of(p)
            except Exception:
                pass
        if not of:
            return None
        c = of[min(of)]
        ident, bound = runtime.budget(c)
        if ident.id in books.boxes:   # two keys of one budget (the claims were matched otherwise then)
            log.warning("taking over: key %d is a second budget of %s; the oldest holds the claim, this one 0",
                        key, ident.id)
            ident = Container(ident.kind, f"{ident.id}#{key}", ident.cgroup, ident.pod)
        name = old.get("name") or (runtime.name_of(c.cgroup, c.short) if ident is c else runtime.budget_name(bound))
        box = Box(key, ident, name, time.monotonic() - (time.time() - old.get("created", time.time())), 0, "",
                  labels=old.get("labels"))
        for p in pids:
            box.add(p, of.get(p))
        runtime.take_claims(box, bound)
        limit, box.source = runtime.limit_of(box)
        box.limit = books.capped(name, limit)
        for field in ("stalled_s", "stalls", "grants", "over_limits", "restalls"):
            setattr(box, field, old.get(field, 0))
        books.boxes[ident.id] = box
        books.by_key[box.key] = box
        books.pid_box.update({p: box for p in box.pids})
        return box

    def stalled(self, all_held: bool) -> list[Event]:
        """The calls the enforcer before us held when it handed over (--handover), as the events
        that stopped them (we never heard those): each thread the pinned `threads` map shows
        stopped at a call. A member's is a stall (reserved where its
        recheck kept its reservation), a process not placed yet's its first call."""
        out = []
        for k, t in self.maps.table("threads").items():
            c = t.call
            pid, tid = k.value >> 32, k.value & 0xFFFFFFFF
            # all_held (it handed over: nothing was let go, and a stop may land a moment after
            # its `held` entry): every such thread; else those its watchdog's resume missed
            if not c.stalled or not c.api or _state(pid, tid) not in (("T", "t", "R", "S", "D") if all_held
                                                                      else ("T", "t")):
                continue   # let go, it meets its recheck (or is gone)
            box = self.books.pid_box.get(pid)
            flags = (EF_RESERVED if c.reserved else 0) | (EF_ORDINAL if c.ordinal else 0)
            out.append(Event(0, pid, tid, "", 0, "stall" if box else "unknown", API_NAMES.get(c.api, f"api{c.api}"),
                             None, c.rdev if c.reserved else c.wdev, box.key if box else 0, c.want, 0, 0, flags))
        return out
