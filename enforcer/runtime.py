"""Run-time changes: `convgpu limit set`, `convgpu run`'s registrations, and a reload of the
config file (SIGHUP, `convgpu reload`)."""
import logging

from ..units import format_size
from .books import Box

log = logging.getLogger(__package__ + ".daemon")   # the Enforcer logs as one: "daemon: ..." (bench/sched, tests read it)


class RuntimeChanges:
    """Part of Enforcer (enforcer/daemon.py): limits and rules changed while it runs."""

    def set_limit(self, container: str, limit: int) -> Box:
        """`convgpu limit set`: until the container exits, beats every other source."""
        box = self.books.find(container)
        self.rules.runtime[box.container.id] = limit
        self._apply_limit(box, self.books.capped(box.name, limit), "convgpu limit set")
        return box

    def _apply_limit(self, box: Box, limit: int, source: str):
        """A new limit: an over-limit waiter may now fit; a lower one takes effect at the next
        allocation (memory already assigned is not taken back)."""
        if (limit, source) == (box.limit, box.source):
            return
        box.limit, box.source = limit, source
        for dev in box.assigned:
            self.broker.revoke(box, dev)
            box.assigned[dev] = min(box.assigned[dev], max(self.books.limit(box, dev), self.books.demand(box, dev)))
            self.write_assign(box, dev)
            if dev in box.waiting:   # its recheck tells again (with its contexts) if it still cannot fit
                w = box.waiting[dev]
                w.over_limit = w.circular = False
                for a in w.asks.values():
                    a.over_limit, a.said = a.size > limit, False
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
            self._apply_limit(box, self.books.capped(box.name, limit), source)
        log.info("config reloaded: %d rules, default limit %s", len(rules.rules),
                 format_size(rules.default))
        return True
