"""Context overhead: what a context is charged before NVML measures it (the device's
estimate, learned from earlier processes: enforcer/ctxest.py), and the measurement that
replaces it once NVML has one."""
import logging
import time

from ..units import format_size
from ..probes import gpumap
from . import ctxest

log = logging.getLogger(__package__ + ".daemon")   # the Enforcer logs as one: "daemon: ..." (bench/sched, tests read it)
LEARN_SAVE_EVERY = 10.0  # s at most between two writes of the learned context estimates


class ContextOverhead:
    """Part of Enforcer (enforcer/daemon.py): estimated from the first moment, measured once NVML can."""

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
        self._check_mappings({pid for pid, _ in nv}, {(pid, dev) for pid, dev in nv})
        for (pid, dev), (over, n) in nv.items():
            # a member only: the sample may be older than an exit already learned (_gone), and
            # its pid would be learned again at its next _gone (a CuPy run on the H100 learned
            # 9 contexts from 6 processes)
            if n > 0 and dev in self.devices and pid in self.pid_box:
                self._peak[(pid, dev)] = max(self._peak.get((pid, dev), 0), over // n)
        return self._recharge()

    def _check_mappings(self, pids: set[int], listed: set[tuple[int, int]]):
        """NVML lists each process under the host GPUs it uses: the check of the mapping made at
        its placement (probes/gpumap.py). Told once per process, in the log and `status`."""
        g = getattr(self.tracer, "gpumap", None)
        for pid in pids & getattr(self.tracer, "mapped", set()) - set(self.contradicted):
            m = g.cache.get(pid, (0, None))[1]
            why = m and gpumap.check(m, {d for p, d in listed if p == pid})
            if why:
                self.contradicted[pid] = why
                log.warning("pid %d: its GPU mapping is contradicted: %s", pid, why)

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
                    self.write_assign(box, dev)
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
