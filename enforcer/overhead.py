"""Context overhead: what a context is charged before NVML measures it (the device's
estimate, measured at start or given: enforcer/ctxest.py), and the
measurement that replaces it once NVML has one.

On a GPU whose model and driver have nothing measured, the enforcer measures a
context at start (enforcer/ctxmeasure.py, once per model and driver) and holds newcomers on
that GPU at their first context until it has (_measure_hold, at most ctxmeasure.TIMEOUT); a
process placed with nothing known was charged 0 before (issue 31: 518 MiB over its limit)."""
import logging
import os
import time

from ..units import format_size
from ..probes import gpumap
from . import ctxest, ctxmeasure
from .actions import alive

log = logging.getLogger(__package__ + ".daemon")   # the Enforcer logs as one: "daemon: ..." (bench/sched, tests read it)
NVML_STALE = 3.0         # s without an NVML sample (one a second) that is said in the log


class ContextOverhead:
    """Part of Enforcer (enforcer/daemon.py): estimated from the first moment, measured once NVML can."""

    def _read_gpus(self) -> dict:
        """index -> probes.nvml.GpuInfo, read once at start: never again from the loop, where an
        NVML call that hangs (a GPU fallen off the bus) would hold every stall and resume."""
        if self.nvml is None or not getattr(self.nvml, "ok", False):
            return {}
        try:
            return {g.index: g for g in self.nvml.gpus()}
        except Exception as e:
            log.warning("NVML cannot list the GPUs (%s): no context is measured", e)
            return {}

    def _devices(self) -> dict[int, ctxest.Device]:
        """Each GPU's model and driver as NVML tells them (keys of what is measured)."""
        gpus = self._gpu_infos
        driver = getattr(self.nvml, "driver", "") or ""
        return {d: ctxest.Device(d, gpus[d].name, gpus[d].uuid, driver) if d in gpus else ctxest.Device(d)
                for d in self.capacity}

    def _choose(self, dev: int) -> ctxest.Estimate:
        d = self.devices[dev]
        return ctxest.choose(d, self.ctx_overhead, self.measured.measured_at_start(d.model_key),
                             self._unmeasured.get(d.model_key, ""))

    def _estimate(self, dev: int) -> ctxest.Estimate:
        e = self.est.get(dev)
        return e if e is not None else ctxest.choose(ctxest.Device(dev), self.ctx_overhead)

    def _ctx(self, dev: int) -> int:
        """Bytes charged per context on dev until NVML measures it."""
        return self._estimate(dev).bytes

    # ---- a context measured at start, where nothing is known (enforcer/ctxmeasure.py) ----
    def _plan_measurements(self):
        """At start: each GPU model and driver with no measurement kept and no --ctx-overhead
        is measured once; newcomers on its GPUs wait."""
        for dev, d in sorted(self.devices.items()):
            if self.ctx_overhead is not None or self.measured.measured_at_start(d.model_key) is not None:
                continue
            why = self._unmeasurable(dev)
            if why:
                self._unmeasured[d.model_key] = why
                log.warning("GPU%d: a context cannot be measured here (%s): charged %s per context (%s)", dev,
                            why, format_size(self._choose(dev).bytes), self._choose(dev).source)
            else:
                if all(m != d.model_key for m, _ in self._measure_queue):
                    self._measure_queue.append((d.model_key, dev))
                self._unmeasured[d.model_key] = "its measurement runs: newcomers wait for it"
                self._measure_wait.add(dev)
        for dev in self.devices:
            self.est[dev] = self._choose(dev)
        # the first measurement starts at the loop's first pass, once admission is on: its child's
        # exemption goes into a control map this enforcer owns (before, during a take-over, the
        # predecessor's programs would stop the child as a newcomer)

    def _unmeasurable(self, dev: int) -> str:
        """Why no context can be measured on dev, or ""."""
        if self.nvml is None or not getattr(self.nvml, "ok", False):
            return "no NVML"
        if self._gpu_infos.get(dev) is None:
            return "NVML does not list it"
        if self._gpu_infos[dev].migs:
            return "MIG mode: NVML counts no process's memory on the whole GPU"
        if self._host_driver() is None:
            return "no host driver to measure with"
        return ""

    def _host_driver(self) -> str | None:
        """The host's own libcuda, never a container's: one the tracer found and trusts, else
        (no probes) one installed on the host that probes/untrusted.py would trust."""
        from . import devattrs
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

    def _measure_step(self, now: float):
        """From the loop: the measurement's outcome once there is one (never waits for it),
        then the next model's measurement."""
        m = self._measuring_now
        if m is not None:
            out = m.result(now)
            if out is None:
                return
            self._measuring_now = None
            self._measured_at_start(m, out)
        if self._measuring_now is None and self._measure_queue:
            model, dev = self._measure_queue.pop(0)
            g = self._gpu_infos[dev]
            self._measuring_now = ctxmeasure.Measurement(model, dev, g.uuid or str(dev), self._host_driver(), self.nvml,
                                                         self._measure_exempt).start()
            log.info("GPU%d: measuring what a context costs on %s (nothing measured; newcomers "
                     "there wait for it, at most %g s)", dev, model, ctxmeasure.TIMEOUT)

    def _measure_exempt(self, pid: int, on: bool):
        """Admission skips the measuring child (cg_control.measuring), from its thread."""
        with self._control_lock:
            if not on and self._measuring != pid:
                return     # a late thread: another child is exempt by now
            self._measuring = pid if on else 0
        if self.tracer.b is not None and self._leaf:   # else the loop's first write carries it
            self._write_control()

    def _measured_at_start(self, m: "ctxmeasure.Measurement", out: "ctxmeasure.Outcome"):
        devs = sorted(d for d in self._measure_wait if self.devices[d].model_key == m.model_key)
        if out.nbytes:
            self.measured.set_measured(m.model_key, out.nbytes)
            self._unmeasured.pop(m.model_key, None)
            self._save_measured()
            log.info("GPU%d: a context measured %s on %s (%s)", m.dev, format_size(out.nbytes), m.model_key, out.why)
        else:
            self._unmeasured[m.model_key] = f"its measurement failed: {out.why}"
            log.warning("GPU%d: the context could not be measured (%s): newcomers go on, charged %s per "
                        "context (%s)", m.dev, out.why, format_size(self._choose(m.dev).bytes), self._choose(m.dev).source)
        self._measure_wait.difference_update(devs)
        for dev in devs:
            self._reestimate(dev)
        self._release_held()

    def _measure_hold(self, e, also) -> bool:
        """A newcomer's first call on a GPU whose context is being measured waits (stopped by
        BPF as unplaced) until the measurement is in; True if it does."""
        devs = ({max(e.dev, 0)} | set(also)) & self._measure_wait
        if not devs:
            return False
        if not any(p == e.pid for p, _ in self._held_new):
            log.info("pid %d waits on GPU%s until a context is measured there", e.pid,
                     ", GPU".join(map(str, sorted(devs))))
        self._held_new[(e.pid, e.tid)] = (e, also)
        return True

    def _release_held(self):
        """Newcomers whose GPUs are measured now are placed, their context call asking for
        the device's estimate (BPF reserved the smaller figure in force when it stopped them:
        pending GPUs are left out of control.ctx_overhead, Actions._control)."""
        for key, (e, also) in list(self._held_new.items()):
            dev = max(e.dev, 0)
            if ({dev} | set(also)) & self._measure_wait:
                continue
            del self._held_new[key]
            if not alive(e.pid):
                continue
            size = max(e.size, self._ctx(dev)) if e.api.startswith(("cuDevicePrimaryCtxRetain", "cuCtxCreate")) \
                else e.size
            self._place(e.pid, dev, size, e.tid, e.result, also)
        self._changed()

    def _measure_overhead(self) -> bool:
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
        self.excess = nv
        self._check_mappings({pid for pid, _ in nv}, {(pid, dev) for pid, dev in nv})
        return self._recharge()

    def _nvml_health(self, now: float):
        """One line when NVML stops answering (an error, or a call that hangs in the sampler's
        thread, never in this loop) and one when it answers again. Meanwhile every context
        stays charged at its last measurement (Sampler keeps it), a new one at its estimate."""
        s = self.sampler
        late = now - s.ok_at
        if late >= NVML_STALE and not self._nvml_failing and s.seq == 0 and "Not Supported" in s.error:
            self._nvml_failing = True   # some vGPUs: no per-process figures at all (_backstop_state)
            log.warning("NVML gives no per-process memory on this host (%s): the backstop is off (memory "
                        "obtained outside admitted calls is not seen), contexts stay charged at the estimate",
                        s.error)
        elif late >= NVML_STALE and not self._nvml_failing:
            self._nvml_failing = True
            log.warning("NVML has not answered for %.0f s (%s): contexts stay charged at their last "
                        "measurement, new ones at the estimate; enforcing goes on", late,
                        s.error or "a call hangs")
        elif late < NVML_STALE and self._nvml_failing:
            self._nvml_failing = False
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

    def _save_measured(self):
        self.measured.save()

    def _tracked(self) -> dict[tuple[int, int], tuple[int, int]]:
        """(pid, dev) -> (live bytes, contexts) as the probes track them: NVML's excess over
        the bytes is the process's measured overhead, for that many contexts."""
        return {(u.pid, u.dev): (u.live, max(u.contexts, 0)) for u in self.tracer.usage()}

    # ---- what the backstop (enforcer/backstop.py) is handed ----
    def _backstop_off(self) -> dict[int, str]:
        """GPU -> why NVML cannot count its processes' memory (the backstop is off there)."""
        if self.nvml is None or not getattr(self.nvml, "ok", False):
            return {d: "no NVML" for d in self.capacity}
        return {d: "MIG mode: NVML counts no process's memory on the whole GPU" for d in self.capacity
                if self._gpu_infos.get(d) is not None and self._gpu_infos[d].migs}

    def _backstop_state(self) -> dict:
        """Whether the backstop runs, per GPU, and why not (status, doctor)."""
        s = self.sampler
        if s is not None and s.seq == 0 and s.error:   # never one answer: NVML lists no process here
            return {str(d): f"off: NVML gives no per-process memory ({s.error})" for d in self.capacity}
        return {str(d): f"off: {self.backstop.off[d]}" if d in self.backstop.off else
                "on" if s is not None else "off: no NVML sampler" for d in self.capacity}

    def _place_stray(self, pid: int):
        """A process NVML counts memory for, never placed (no admitted call): its container's."""
        box = self._box_for(pid)
        if box is None or self._process_quota_full(box, pid):
            return None
        self._join(box, pid)
        log.warning("pid %d of %s holds GPU memory and made no call convgpu admits: placed by what it holds",
                    pid, box.name)
        return box

    def _waits_whole(self, box, pid: int) -> bool:
        """pid is stopped at a call BPF holds, its whole process stopped with it: a SIGCONT
        would let it into its call (its recheck would stop it again), so the decider resumes it."""
        return any(a.pid == pid for w in box.waiting.values() for a in w.asks.values()) and self._held_whole(pid)

    def _own_pids(self) -> set[int]:
        return {os.getpid(), self._exempt, self._measuring} | ({self.watchdog.pid} if self.watchdog else set())

    def _accounted(self) -> dict[tuple[int, int], int]:
        """(pid, GPU) -> what the probes account for: its live bytes and contexts at the estimate."""
        return {(u.pid, u.dev): u.live + max(u.contexts, 0) * self._ctx(u.dev) for u in self.tracer.usage()}

    def _calls_of(self, pid: int, dev: int) -> str:
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

    # ---- what a stack limit costs per byte on each GPU (enforcer/devattrs.py, issue 39) ----
    def _write_resident(self):
        """Each GPU's resident threads into BPF's `resident` map, before admission: kept per
        model and driver in the state dir, else asked of the host's driver once (a child that
        makes no context). Unknown: BPF charges a stack for more threads than any GPU has."""
        from . import devattrs
        known = {d: self.measured.resident.get(self.devices[d].model_key) for d in self.devices}
        lib = self._host_driver()
        if any(v is None for v in known.values()) and lib is not None:
            asked = devattrs.query(lib, list(self._gpu_infos.values()))
            for d, threads in asked.items():
                if d in self.devices:
                    known[d] = threads
                    self.measured.set_resident(self.devices[d].model_key, threads)
            self._save_measured()
        devattrs.write(self.tracer.b, known)
