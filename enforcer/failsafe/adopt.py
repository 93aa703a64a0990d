"""Taking over: load the BPF program over the maps a previous enforcer left pinned (its
watchdog kept them exact) and adopt its containers, assignments and counters."""
import logging
import os
import time

from ...units import format_size
from . import takeover
from ..actions import alive
from ..books import Box
from ..serving.broker import SHIM_MEMBER

log = logging.getLogger("convgpu.enforcer.daemon")   # the Enforcer logs as one: "daemon: ..." (bench/sched, tests read it)


class Adopt:
    """Part of Enforcer (enforcer/daemon.py): the start after a crashed or replaced enforcer."""

    def _load_over_pins(self) -> list[dict]:
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
            if alive(k.value):
                pids.setdefault(v.value & ~SHIM_MEMBER, set()).add(k.value)
            else:
                del members[k]
        for name in ("assign", "cgstate"):
            t = self._t(name)
            for k, a in list(t.items()):
                if k.container not in pids:
                    del t[k]
        for name in ("quotas", "swept"):   # map quota buckets of containers gone meanwhile (enforcer/quotas.py)
            t = self._t(name)
            for k in [k for k in t.keys() if k.value not in pids]:
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
                          self.books.capped(name, limit), source, labels=old.get("labels"))
                for key in ("stalled_s", "stalls", "grants", "over_limits", "restalls"):
                    setattr(box, key, old.get(key, 0))
                box.pids = pids[k.container]
                self.boxes[c.id] = box
                self.by_key[box.key] = box
                self.pid_box.update({p: box for p in box.pids})
            box.assigned[k.dev] = a.assigned
            box.extra[k.dev] = a.extra_overhead
            box.adopted[k.dev] = (a.adopted, a.adopted_contexts)
            st = self._state(box, k.dev)   # exits the old enforcer saw no pidfd of: freed by now
            box.torn[k.dev] = st.tearing if st is not None else a.torn
            charge[(box.key, k.dev)] = a.ctx_charge
        for box in self.boxes.values():
            for dev in box.assigned:
                # its extra was relative to the old per-context charge (our estimate may differ,
                # e.g. a measurement at start that came in meanwhile): keep the container's total as it was
                _, contexts, _ = self.books.usage(box, dev)
                box.extra[dev] += contexts * (charge.get((box.key, dev), self._ctx(dev)) - self._ctx(dev))
                self.write_assign(box, dev)
        self._next_key = max(self.by_key, default=0) + 1
        log.info("took over from enforcer %s: %d containers, %s assigned", 
                 ", ".join(os.path.basename(st["path"])[5:-5] for st in prev), len(self.boxes),
                 format_size(sum(sum(b.assigned.values()) for b in self.boxes.values())))
