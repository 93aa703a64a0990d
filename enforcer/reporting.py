"""Reporting: `convgpu status` (and the metrics built from it), `convgpu trace`'s snapshot,
and the state file the watchdog reads to resume whoever we held if we die."""
import os
import time

from ..faults import FAULT
from ..units import format_size
from .books import Box
from .failsafe.stall import SignalStopper
from .failsafe.watchdog import write_state


class Reporter:
    """What the enforcer shows, and what it leaves for the watchdog: it reads every part and
    changes none. Handed the tracer (its counters, libraries, GPU mappings, discovery), the
    books, the decider (its settings), ContextCharge (the charges, NVML's sample, mapping checks),
    the backstop, the shim broker (credit, asks, ceilings), Quotas, Holds, Runtime (its rules,
    decisions, registered runs), the history, Admission (a view turns alloc/free events on),
    `convgpu trace`'s accountant, the stall backend, and what is fixed at start: the state
    file's path, watchdog_pid() (None until it runs), --unprobed, --unmapped-charge, when it
    started and --handover (the state file tells the watchdog how long a successor may take)."""

    def __init__(self, tracer, books, decider, charge, backstop, broker, quotas, holds, runtime, history,
                 admission, acct, stopper, state_file: str, watchdog_pid, unprobed: str, unmapped_charge: str,
                 started: float, handover: float = 0.0, swapper=None):
        self.tracer, self.books, self.decider, self.charge, self.charges = tracer, books, decider, charge, charge.charges
        self.swapper = swapper
        self.backstop, self.broker, self.quotas, self.holds, self.runtime = backstop, broker, quotas, holds, runtime
        self.history, self.admission, self.acct, self.stopper = history, admission, acct, stopper
        self.state_file, self.watchdog_pid, self.unprobed = state_file, watchdog_pid, unprobed
        self.unmapped_charge, self.started, self.handover = unmapped_charge, started, handover
        self.release = None   # argv of the swap release agent (enforcer/swap/agent.py), once swap runs
        self._saved = None

    def status(self) -> dict:
        now = time.monotonic()
        gpus, backstop = {}, self._backstop_state()
        for dev, cap in sorted(self.books.capacity.items()):
            assigned = self.books.assigned(dev)
            est = self.charges.estimate(dev)
            gpus[str(dev)] = {"uuid": self._uuid(dev), "capacity": cap, "assigned": assigned,
                              "unassigned": cap - assigned, "committed": self.books.committed(dev),
                              "physical": self.books.physical[dev], "tearing_down": self.books.tearing(dev),
                              "ctx_estimate": est.to_json(), "ctx_measuring": dev in self.charges.waiting,
                              "backstop": backstop[str(dev)],
                              # memory NVML counts that nobody can be shown to hold (enforcer/attribution.py)
                              "unattributed": self.books.unattributed.get(dev, 0),
                              # containers with no process left that hold memory their gone processes left
                              "left_by_exited": [r for r in self.backstop.gone_rows(now) if r["gpu"] == dev],
                              # whether swap can be (enforcer/swap/): "on", or "off: why"
                              "swap": self._swap_state(dev)}
        rows = []
        sampler = self.charge.sampler
        raw = sampler.raw if sampler is not None else None
        found = self.backstop.found
        for box in sorted(self.books.boxes.values(), key=lambda b: b.created):
            per = {}
            for dev in sorted(box.assigned):
                used, contexts, reserved = self.books.usage(box, dev)
                w = box.waiting.get(dev)
                over = self.backstop.status(box.container.id, dev, now)
                per[str(dev)] = {
                    "limit": self.books.limit(box, dev), "assigned": box.assigned[dev], "used": used,
                    "context_overhead": self.books.ctx_held(box, dev, 0, contexts),
                    "context_source": self._ctx_source(box, dev, contexts),
                    "reserved": reserved, "contexts": contexts, "waiting": w is not None,
                    # what it holds and its stopped calls ask: above the limit, only a new one helps
                    "demand": self.books.demand(box, dev),
                    "shim_credit": self.broker.unspent(box, dev),
                    "over_limit": bool(w and w.over_limit) or over["over_by"] > 0,
                    # the driver's count (NVML) against the limit, as the backstop attributed it
                    # (enforcer/attribution.py: its strays not placed at the process quota and what
                    # its gone processes left too, issue 47), else its placed processes' rows
                    "nvml_used": None if raw is None else found.held.get((box.container.id, dev), 0)
                    if found is not None and dev not in self.backstop.off
                    else sum(raw.get((p, dev), 0) for p in box.pids),
                    "over_by": over["over_by"], "over_s": over["over_s"],
                    # memory its exited processes left (another process keeps the driver's files)
                    "left_by_exited": over["left_by_exited"],
                    # in host memory by the driver's checkpoint (enforcer/swap/): bytes, seconds, processes
                    **(self.swapper.status(box, dev) if self.swapper is not None else {}),
                    "circular": bool(w and w.circular),
                    "tearing_down": self._tearing_of(box, dev),
                    "waiting_s": round(now - w.since, 3) if w else 0.0,
                    "waiting_pids": sorted(w.pids) if w else [],
                    # one per stopped call: a wait belongs to a thread (docs/ENFORCE.md, "Waits")
                    "waits": [{"pid": a.pid, "tid": a.tid, "size": a.size, "waiting_s": round(now - a.since, 3),
                               "over_limit": a.over_limit, "held": self._hold_mode(a.pid)}
                              for a in sorted(w.asks.values(), key=lambda a: a.since)] if w else []}
            stalled = box.stalled_s + sum(now - w.since for w in box.waiting.values())
            rows.append({"id": box.container.id, "name": box.name, "kind": box.container.kind,
                         "cgroup": box.container.cgroup, "limit": box.limit, "source": box.source,
                         # the containers it holds, each with its processes (a DRA claim's budget:
                         # every container and pod that uses the claim, issue 48)
                         "consumers": [{"id": m.id, "kind": m.kind, "cgroup": m.cgroup, "pod": m.pod,
                                        "pids": box.member_pids(m.id)} for m in sorted(
                                            box.members.values(), key=lambda m: (m.pod or "", m.cgroup))],
                         "claims": sorted(box.claims),
                         "pids": sorted(box.pids), "gpus": per, "stalled_s": round(stalled, 3),
                         "stalls": box.stalls, "grants": box.grants,
                         "over_limit_events": box.over_limits, "circular_waits": box.circulars, "restalls": box.restalls,
                         "map_quota": self.quotas.status(box)})
        quota, holder = self.quotas.quota, self.holds.holder
        return {"pid": os.getpid(), "policy": self.decider.policy, "over_limit": self.decider.over_limit,
                "map_quota": {"objects": quota.objects, "threads": quota.threads,
                              "processes": quota.processes},
                "stall": "signal" if isinstance(self.stopper, SignalStopper) else "freezer",
                # how a stopped call is held: its thread alone (ptrace), or its whole process
                # where ptrace was refused (pid -> why), or its whole container (the freezer)
                "holds": {"threads": "ptrace" if holder is not None else "container" if not
                          isinstance(self.stopper, SignalStopper) else "process",
                          "whole_process": {str(p): why for p, why in
                                            sorted((holder.refused if holder else {}).items())},
                          "seized": sorted(holder.traced) if holder else []},
                "ctx_overhead": self.charges.operator, "default_limit": self.runtime.rules.default,
                # run-time limits and names: where they are kept, and whether they could be
                "decisions": self.runtime.durable.status(),
                "history": self.history.status(),   # each job's runs (enforcer/history/, docs/RECOMMEND.md)
                "started": self.started, "shim_asks": self.broker.asks,
                # per GPU, what the shim's memory queries leave for a context NVML has not measured
                "shim_ctx_ceiling": {str(d): self.broker.ceiling(d).to_json() for d in sorted(self.books.capacity)},
                "gpus": gpus, "containers": rows,
                # `convgpu run` jobs known by name before their first CUDA call (issue 39 part 4)
                "registered": self.runtime.registered(),
                # allocations and contexts let through while the heartbeat had lapsed (BPF's count)
                "unchecked_calls": self.tracer.stats()["unchecked"], **self._discovery_status(),
                **self._mapping_status()}

    def _backstop_state(self) -> dict:
        """Whether the backstop runs, per GPU, and why not (status, doctor)."""
        s, capacity = self.charge.sampler, self.books.capacity
        if s is not None and s.seq == 0 and s.error:   # never one answer: NVML lists no process here
            return {str(d): f"off: NVML gives no per-process memory ({s.error})" for d in capacity}
        if s is not None and self.charge.nvml_failing:   # no new sample: no new finding (what it stopped stays)
            return {str(d): f"off: {self.backstop.off.get(d, 'NVML has stopped answering')}" for d in capacity}
        return {str(d): f"off: {self.backstop.off[d]}" if d in self.backstop.off else
                "on" if s is not None else "off: no NVML sampler" for d in capacity}

    def _swap_state(self, dev: int) -> str:
        if self.swapper is None:
            return "off: not built"
        if self.backstop.off.get(dev, "").startswith("MIG"):
            return "off: MIG mode (the checkpoint of a MIG instance's process is not known to work)"
        why = self.swapper.why_off()
        return f"off: {why}" if why else "on"

    def _uuid(self, dev: int) -> str:
        g = getattr(self.tracer, "gpumap", None)
        return g.uuid(dev) if g is not None else ""

    def _mapping_status(self) -> dict:
        """Each placed process's CUDA devices as host GPUs (probes/gpumap.py); `certain` false:
        the evidence did not fix them, and `also` is where its bytes count as well."""
        g = getattr(self.tracer, "gpumap", None)
        if g is None:   # --no-probes
            return {}
        rows = [{"pid": pid, **m.to_json(), "contradiction": self.charge.contradicted.get(pid, "")}
                for pid in sorted(self.tracer.mapped) if (m := g.cache.get(pid, (0, None))[1]) is not None]
        return {"unmapped_charge": self.unmapped_charge, "gpu_mappings": rows}

    def _hold_mode(self, pid: int) -> str:
        if not isinstance(self.stopper, SignalStopper):
            return "container"
        return self.holds.mode(pid)

    def _tearing_of(self, box: Box, dev: int) -> int:
        """Bytes of the container's exited processes the driver has not freed yet."""
        s = self.books.state_of(box, dev) if self.tracer.kernel else None
        return max(0, s.tearing - box.torn.get(dev, 0)) if s is not None else 0

    def _discovery_status(self) -> dict:
        d = getattr(self.tracer, "discovery", None)
        if d is None:   # --no-probes
            return {}
        # recent: the pids stopped at an open, latest last (the last 1,024), one entry a stop:
        # a test counts its own process's stops exactly while other processes of the host open
        # driver files of their own
        return {"probes": {"attached": len(self.tracer.attached), "failed": len(self.tracer.failed)},
                "discovery": {"on": d.enabled, "stops": d.stops, "node_stops": d.identity.stops,
                              "recent": list(d.recent), "unprobed_policy": self.unprobed},
                "unprobed": [vars(u) for u in d.unprobed.values()]}

    def _ctx_source(self, box: Box, dev: int, contexts: int) -> str:
        """Where a container's context charge on dev comes from: NVML measured all of it, some
        of it (the rest: the device's estimate), or none yet."""
        if not contexts:
            return "none"
        excess = self.charges.excess
        measured = sum(excess[(p, dev)][1] for p in box.pids if (p, dev) in excess)
        if not measured:
            return self.charges.estimate(dev).source
        return "measured" if measured >= contexts else "measured+" + self.charges.estimate(dev).source

    def snapshot(self, pids=None, container=None) -> dict:
        """`convgpu trace`'s view, with our state in it. A view turns alloc/free events on (from
        now: what came before was not kept) until VIEW_GRACE after its last snapshot."""
        self.admission.view()
        snap = self.acct.snapshot(self.tracer.usage(), libraries=[str(x) for x in self.tracer.libraries],
                                  drops=self.tracer.stats()["drops"], pids=pids, container=container)
        d = snap.to_json()
        d["enforce"] = self.status()
        return {"snapshot": d, "events": [e.to_json(self._uuid(e.dev)) for e in self.acct.recent]}

    def save_held(self):
        """What the watchdog must undo if we die: every waiting pid, every frozen cgroup."""
        pids, cgroups = set(), set()
        for box in self.books.boxes.values():
            for w in box.waiting.values():
                pids |= w.pids
                if not isinstance(self.stopper, SignalStopper):
                    pids |= box.pids
                    cgroups |= {self.stopper.root.rstrip("/") + cg for cg in box.cgroups}
        stopped, frozen = self.backstop.held()   # over a limit by the driver's count
        pids |= stopped
        cgroups |= frozen
        boxes = {str(b.key): {"name": b.name, "created": int(time.time() - (time.monotonic() - b.created)),
                              "labels": b.labels, "stalled_s": b.stalled_s, "stalls": b.stalls,
                              "grants": b.grants, "over_limits": b.over_limits, "restalls": b.restalls}
                 for b in self.books.boxes.values()}
        state = (sorted(pids), sorted(cgroups), boxes, self.watchdog_pid(), self.release)
        if state == self._saved:   # the file is rewritten (rename) only when it changes
            return
        self._saved = state
        if FAULT:
            FAULT.hit("held")   # the watchdog's file still lists what was held before
        write_state(self.state_file, pids, cgroups, boxes=boxes, saved=time.time(), watchdog=state[3],
                    handover=self.handover, release=self.release)

    def capacity_text(self) -> str:
        return ", ".join(f"GPU{d} {format_size(c)}" for d, c in sorted(self.books.capacity.items()))
