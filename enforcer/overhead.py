"""Context overhead: what a context is charged before NVML measures it (the device's estimate,
measured at start or given: enforcer/ctxest.py), and the measurement that replaces it once NVML
has one.

On a GPU whose model and driver have nothing measured, the enforcer measures a context at start
(enforcer/ctxmeasure.py, once per model and driver) and holds newcomers on that GPU at their
first context until it has (hold_newcomer, at most ctxmeasure.TIMEOUT); a process placed with
nothing known was charged 0 before (issue 31: 518 MiB over its limit)."""
import logging
import os
import time

from ..units import format_size
from ..probes import gpumap
from . import ctxmeasure, devattrs
from .actuator import alive

log = logging.getLogger(__package__ + ".daemon")   # the Enforcer logs as one: "daemon: ..." (bench/sched, tests read it)
NVML_STALE = 3.0         # s without an NVML sample (one a second) that is said in the log


def read_gpus(nvml) -> dict:
    """index -> probes.nvml.GpuInfo, read once at start: never again from the loop, where an
    NVML call that hangs (a GPU fallen off the bus) would hold every stall and resume."""
    if nvml is None or not getattr(nvml, "ok", False):
        return {}
    try:
        return {g.index: g for g in nvml.gpus()}
    except Exception as e:
        log.warning("NVML cannot list the GPUs (%s): no context is measured", e)
        return {}


class ContextCharge:
    """Changes what a context is charged (ctxest.Charges) and what each container is charged for
    its processes' contexts (box.extra, written through write_assign). Handed the tracer (usage,
    libraries, GPU mappings), NVML and its GPUs (read once), the charges, the books (whose
    containers it recharges), write_assign(box, dev) (BpfMaps) and Admission (a new estimate
    changes what a newcomer reserves; the measuring child is exempt). It also keeps what the
    backstop's line names: the calls no admission sizes that each process made."""

    def __init__(self, tracer, nvml, gpus: dict, charges, books, write_assign, admission):
        self.tracer, self.nvml, self.gpus, self.charges, self.books = tracer, nvml, gpus, charges, books
        self.write_assign, self.admission = write_assign, admission
        self.sampler = None                      # NVML's per-process memory, sampled in a thread (start_sampler)
        self.queue: list[tuple[str, int]] = []   # (model key, GPU) to measure a context on
        self.measuring_now = None                # the ctxmeasure.Measurement running
        self.held_new: dict = {}                 # (pid, tid) -> (event, also): waiting for a measurement
        self.nvml_failing = False                # said once: NVML stopped answering
        self.contradicted: dict[int, str] = {}   # pid -> what NVML's lists say against its mapping
        self.calls_seen: dict[int, dict[str, int]] = {}   # pid -> calls no admission sizes, seen in events

    def start_sampler(self, every: float):
        """Once the probes' maps exist: a sample reads them, and failed until then, which read as
        "NVML has not answered for 7 s" at every start on a GPU host."""
        if self.nvml is not None and self.nvml.ok:
            from ..probes.nvml import Sampler
            self.sampler = Sampler(self.nvml, every, self.tracked, self.tracer.calls_in_flight, contexts=True).start()

    def close(self):
        if self.sampler is not None:
            self.sampler.close()
        if self.measuring_now is not None:   # its child goes (newcomers it held: Actuator.resume_unplaced)
            self.measuring_now.result(float("inf"))
        self.charges.measured.save()

    # ---- a context measured at start, where nothing is known (enforcer/ctxmeasure.py) ----
    def plan(self):
        """At start: each GPU model and driver with no measurement kept and no --ctx-overhead
        is measured once; newcomers on its GPUs wait."""
        c = self.charges
        for dev, d in sorted(c.devices.items()):
            if c.operator is not None or c.measured.measured_at_start(d.model_key) is not None:
                continue
            why = self.unmeasurable(dev)
            if why:
                c.unmeasured[d.model_key] = why
                log.warning("GPU%d: a context cannot be measured here (%s): charged %s per context (%s)", dev,
                            why, format_size(c.choose(dev).bytes), c.choose(dev).source)
            else:
                if all(m != d.model_key for m, _ in self.queue):
                    self.queue.append((d.model_key, dev))
                c.unmeasured[d.model_key] = "its measurement runs: newcomers wait for it"
                c.waiting.add(dev)
        for dev in c.devices:
            c.est[dev] = c.choose(dev)
        # the first measurement starts at the loop's first pass, once admission is on: its child's
        # exemption goes into a control map this enforcer owns (before, during a take-over, the
        # predecessor's programs would stop the child as a newcomer)

    def unmeasurable(self, dev: int) -> str:
        """Why no context can be measured on dev, or ""."""
        if self.nvml is None or not getattr(self.nvml, "ok", False):
            return "no NVML"
        if self.gpus.get(dev) is None:
            return "NVML does not list it"
        if self.gpus[dev].migs:
            return "MIG mode: NVML counts no process's memory on the whole GPU"
        if self.host_driver() is None:
            return "no host driver to measure with"
        return ""

    def host_driver(self) -> str | None:
        """The host's own libcuda, never a container's: one the tracer found and trusts, else
        (no probes) one installed on the host that probes/untrusted.py would trust."""
        found = devattrs.host_driver(self.tracer.libraries)
        if found is not None:
            return found
        from ..probes import libs, untrusted
        for path in libs.system_drivers():
            try:
                if untrusted.trusted(path, os.stat(path, follow_symlinks=False)):
                    return path
            except OSError:
                continue
        return None

    def measuring(self) -> bool:
        return self.measuring_now is not None or bool(self.queue)

    def measured(self, now: float):
        """From the loop: the measurement's outcome once there is one (never waits for it). None
        while it runs; else the newcomers to place now that their GPUs are measured, one at a time
        as they are placed: (event, also, the size its call asks)."""
        m = self.measuring_now
        if m is None:
            return None
        out = m.result(now)
        if out is None:
            return None
        self.measuring_now = None
        c = self.charges
        devs = sorted(d for d in c.waiting if c.devices[d].model_key == m.model_key)
        if out.nbytes:
            c.measured.set_measured(m.model_key, out.nbytes)
            c.unmeasured.pop(m.model_key, None)
            c.measured.save()
            log.info("GPU%d: a context measured %s on %s (%s)", m.dev, format_size(out.nbytes), m.model_key, out.why)
        else:
            c.unmeasured[m.model_key] = f"its measurement failed: {out.why}"
            log.warning("GPU%d: the context could not be measured (%s): newcomers go on, charged %s per "
                        "context (%s)", m.dev, out.why, format_size(c.choose(m.dev).bytes), c.choose(m.dev).source)
        c.waiting.difference_update(devs)
        for dev in devs:
            self.reestimate(dev)
        return self._released()

    def measure_next(self):
        """The next model's measurement, once none runs."""
        if self.measuring_now is None and self.queue:
            model, dev = self.queue.pop(0)
            g = self.gpus[dev]
            self.measuring_now = ctxmeasure.Measurement(model, dev, g.uuid or str(dev), self.host_driver(), self.nvml,
                                                        self.admission.exempt_measuring).start()
            log.info("GPU%d: measuring what a context costs on %s (nothing measured; newcomers "
                     "there wait for it, at most %g s)", dev, model, ctxmeasure.TIMEOUT)

    def hold_newcomer(self, e, also) -> bool:
        """A newcomer's first call on a GPU whose context is being measured waits (stopped by
        BPF as unplaced) until the measurement is in; True if it does."""
        devs = ({max(e.dev, 0)} | set(also)) & self.charges.waiting
        if not devs:
            return False
        if not any(p == e.pid for p, _ in self.held_new):
            log.info("pid %d waits on GPU%s until a context is measured there", e.pid,
                     ", GPU".join(map(str, sorted(devs))))
        self.held_new[(e.pid, e.tid)] = (e, also)
        return True

    def _released(self):
        """Newcomers whose GPUs are measured now, their context call asking for the device's
        estimate (BPF reserved the smaller figure in force when it stopped them: pending GPUs
        are left out of control.ctx_overhead, Charges.newcomer_charge)."""
        for key, (e, also) in list(self.held_new.items()):
            dev = max(e.dev, 0)
            if ({dev} | set(also)) & self.charges.waiting:
                continue
            del self.held_new[key]
            if not alive(e.pid):
                continue
            size = max(e.size, self.charges.ctx(dev)) if e.api.startswith(("cuDevicePrimaryCtxRetain", "cuCtxCreate")) \
                else e.size
            yield e, also, size

    # ---- NVML's measurement of each process ----
    def measure_overhead(self) -> bool:
        """NVML's per-process memory beyond the bytes the probes track is each process's real
        context overhead (FACTS.md: ~519 MiB on the H100). BPF charges every context the
        device's estimate from its first moment; for each process NVML has measured, the
        container's extra_overhead replaces that estimate with the measurement (measured less
        contexts x estimate, negative where the estimate was high), so no context is charged
        both ways."""
        if self.sampler is not None:
            self._nvml_health(time.monotonic())
        nv = self.sampler.take() if self.sampler is not None else None
        if nv is None:
            return False
        # a pid a gone member left memory under, now another process's: its row mixes the two
        # (the backstop splits it), so it measures no context (enforcer/attribution.py)
        fresh = {k: v for k, v in nv.items() if k[0] not in self.books.departed}
        # a swapped process (enforcer/swap/) is listed with nothing while it is out: its context
        # keeps the measurement it went out with, which its container was credited
        fresh.update({k: v for k, v in self.charges.excess.items() if k[0] in self.books.swapped_pids and k not in fresh})
        self.charges.excess = fresh
        self._check_mappings({pid for pid, _ in nv}, {(pid, dev) for pid, dev in nv})
        return self.recharge()

    def _nvml_health(self, now: float):
        """One line when NVML stops answering (an error, or a call that hangs in the sampler's
        thread, never in this loop) and one when it answers again. Meanwhile every context
        stays charged at its last measurement (Sampler keeps it), a new one at its estimate."""
        s = self.sampler
        late = now - s.ok_at
        if late >= NVML_STALE and not self.nvml_failing and s.seq == 0 and "Not Supported" in s.error:
            self.nvml_failing = True   # some vGPUs: no per-process figures at all (Reporter's backstop state)
            log.warning("NVML gives no per-process memory on this host (%s): the backstop is off (memory "
                        "obtained outside admitted calls is not seen), contexts stay charged at the estimate",
                        s.error)
        elif late >= NVML_STALE and not self.nvml_failing:
            self.nvml_failing = True
            log.warning("NVML has not answered for %.0f s (%s): contexts stay charged at their last "
                        "measurement, new ones at the estimate; enforcing goes on", late,
                        s.error or "a call hangs")
        elif late < NVML_STALE and self.nvml_failing:
            self.nvml_failing = False
            log.info("NVML answers again: contexts are measured again")

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

    def recharge(self, devs=None) -> bool:
        """box.extra from the last NVML sample and the estimates in force; written where changed."""
        changed = False
        excess = self.charges.excess
        for box in self.books.boxes.values():
            for dev in box.assigned:
                if devs is not None and dev not in devs:
                    continue
                est = self.charges.ctx(dev)
                extra = sum(over - n * est for over, n in
                            (excess[(pid, dev)] for pid in box.pids if (pid, dev) in excess))
                if extra != box.extra.get(dev, 0) or devs is not None:
                    box.extra[dev] = extra
                    self.write_assign(box, dev)
                    changed = True
        return changed

    def reestimate(self, dev: int):
        c = self.charges
        new = c.choose(dev)
        old = c.est.get(dev)
        if new == old:
            return
        c.est[dev] = new
        if old is None or new.bytes != old.bytes:
            log.info("GPU%d: a context is charged %s before NVML measures it (%s: %s)", dev,
                     format_size(new.bytes), new.source, new.detail)
            if self.tracer.b is not None:
                self.recharge({dev})   # extra is relative to the estimate: both change at once
                self.admission.rewrite()

    def tracked(self) -> dict[tuple[int, int], tuple[int, int]]:
        """(pid, dev) -> (live bytes, contexts) as the probes track them: NVML's excess over
        the bytes is the process's measured overhead, for that many contexts."""
        return {(u.pid, u.dev): (u.live, max(u.contexts, 0)) for u in self.tracer.usage()}

    # ---- what the backstop (enforcer/backstop.py) is handed ----
    def backstop_off(self, capacity) -> dict[int, str]:
        """GPU -> why NVML cannot count its processes' memory (the backstop is off there)."""
        if self.nvml is None or not getattr(self.nvml, "ok", False):
            return {d: "no NVML" for d in capacity}
        return {d: "MIG mode: NVML counts no process's memory on the whole GPU" for d in capacity
                if self.gpus.get(d) is not None and self.gpus[d].migs}

    def accounted(self) -> dict[tuple[int, int], int]:
        """(pid, GPU) -> what the probes account for: its live bytes and contexts at the estimate."""
        return {(u.pid, u.dev): u.live + max(u.contexts, 0) * self.charges.ctx(u.dev) for u in self.tracer.usage()}

    def saw_call(self, pid: int, api: str):
        """A call no admission sizes (probes/table.py INDIRECT), named if its process goes over."""
        seen = self.calls_seen.setdefault(pid, {})
        seen[api] = seen.get(api, 0) + 1

    def calls_of(self, pid: int, dev: int) -> str:
        """What a process did, for the line that says it is over its limit."""
        rows = [u for u in self.tracer.usage() if u.pid == pid and u.dev == dev]
        nv = self.sampler.raw.get((pid, dev), 0) if self.sampler is not None else 0
        text = f"{format_size(nv)} by the driver's count"
        if rows:
            u = rows[0]
            text += (f", {format_size(u.live)} in {u.n_alloc - u.n_free} live admitted allocations"
                     f" ({u.n_alloc} made), {max(u.contexts, 0)} contexts")
        seen = self.calls_seen.get(pid)
        if seen:
            text += ", other calls: " + ", ".join(f"{api} x{n}" for api, n in sorted(seen.items()))
        return text

    def forget(self, pid: int):
        """pid is gone (an exit or an exec)."""
        self.contradicted.pop(pid, None)
        self.calls_seen.pop(pid, None)

    # ---- what a stack limit costs per byte on each GPU (enforcer/devattrs.py, issue 39) ----
    def resident(self) -> dict[int, int | None]:
        """Each GPU's resident threads, for BPF's `resident` map before admission: kept per
        model and driver in the state dir, else asked of the host's driver once (a child that
        makes no context). Unknown (None): BPF charges a stack for more threads than any GPU has."""
        c = self.charges
        known = {d: c.measured.resident.get(c.devices[d].model_key) for d in c.devices}
        lib = self.host_driver()
        if any(v is None for v in known.values()) and lib is not None:
            asked = devattrs.query(lib, list(self.gpus.values()))
            for d, threads in asked.items():
                if d in c.devices:
                    known[d] = threads
                    c.measured.set_resident(c.devices[d].model_key, threads)
            c.measured.save()
        return known
