"""Run-time changes: `convgpu limit set`, `convgpu run`'s registrations, the Kubernetes agents'
limits (serving/podlimits.py, serving/claimlimits.py), and a reload of the config file (SIGHUP,
`convgpu reload`). Each decision is made durable (tenants/durable.py: written to the state dir
and fsynced) before it is applied and acknowledged; one that cannot be written is refused, and
nothing changes."""
import logging

from ..errors import ConvgpuError
from ..units import format_size
from . import ctxest
from .books import Ambiguous, Box
from .tenants import durable
from .tenants.decisionfile import LimitSet, Run
from .tenants.containers import Container, container_of_path

SWEEP_EVERY = 2.0   # s between looks for containers gone that left a decision behind

log = logging.getLogger(__package__ + ".daemon")   # the Enforcer logs as one: "daemon: ..." (bench/sched, tests read it)


def gpu_key(gpus: dict, dev: int) -> str:
    """A GPU's key as the Kubernetes agents name it: NVML's uuid (read at start: a limit is worked
    out in the loop, where an NVML call that hangs would hold admission), else gpu<index>."""
    g = gpus.get(dev)
    return g.uuid if g is not None and g.uuid else f"gpu{dev}"


def share_of(rules, gpus: dict):
    """(box, dev) -> its limit on one GPU: its own, or where its pod's grant spans GPUs, the
    pod's share on this one (the Kubernetes agent's split, docs/KUBERNETES.md), or a DRA claim
    budget's share there (0 on a GPU its claims do not name): Books.share_of."""
    return lambda box, dev: rules.share(box.container, gpu_key(gpus, dev), box.limit, box.source,
                                        rules.budget(box.claims))


class Runtime:
    """Owns the limit rules (one LimitRules, changed in place: a reload takes the file's part),
    the names `convgpu run` gave, and the durable decisions behind both. Handed the books (its
    containers, their limits), the decider (its settings; schedule() once a limit changed),
    revoke(box, dev) (the shim's credit back before a limit changes: ShimCredit), write_assign
    (BpfMaps), write_control(enforcing) (Admission: --over-limit kill is back once the decisions
    are read), reload_config() -> (LimitRules, settings) (None: no config file), NVML's GPUs, and
    estimate(dev) (ctxest.Charges.estimate: a limit no context fits in is refused or said)."""

    def __init__(self, rules, store: durable.Store, books, decider, revoke, write_assign, write_control,
                 reload_config=None, gpus: dict | None = None, estimate=None):
        self.rules, self.durable, self.books, self.decider = rules, store, books, decider
        self.estimate = estimate   # dev -> ctxest.Estimate: what a context is charged there
        self.revoke, self.write_assign, self.write_control = revoke, write_assign, write_control
        self.reload_config, self.gpus = reload_config, gpus or {}
        self.over_limit_asked = decider.over_limit   # in force unless the decisions are unreadable
        self.names: dict[str, str] = {}   # cgroup -> name given by `convgpu run --name`
        self._swept = 0.0
        self.reload_error = ""   # why the last reload failed (`convgpu reload` prints it)
        self.said_small: set = set()   # pod limits no context fits in, said once each

    def gpu_key(self, dev: int) -> str:
        return gpu_key(self.gpus, dev)

    def name_of(self, cgroup: str, default: str) -> str:
        return self.names.get(cgroup, default)

    # ---- budgets (issue 48): a DRA claim's is shared by every container that uses it ----
    def budget(self, c: Container) -> tuple[Container, frozenset]:
        """What c's processes are charged to: (the Container that names the budget, the uids of
        the claims that bind c). Its own where no claim binds it; else the budget that holds
        one of those claims (the first, by uid), else a new one named after the first claim.
        A container already placed stays in its budget (Books.member_box): memory is never
        moved between budgets."""
        bound = frozenset(self.rules.binding(c))
        if not bound:
            return c, bound
        holder = {u: b for b in self.books.boxes.values() for u in b.claims}
        got = next((holder[u] for u in sorted(bound) if u in holder), None)
        if got is not None:
            return got.container, bound
        first = min(bound)
        return Container("claim", f"claim:{first}", "", None), bound

    def budget_name(self, bound) -> str:
        return " + ".join(self.rules.claims[u].ref for u in sorted(bound) if u in self.rules.claims)

    def take_claims(self, box: Box, bound) -> None:
        """box holds the claims of `bound` that no other budget holds (and none unprepared)."""
        others = {u for b in self.books.boxes.values() if b is not box for u in b.claims}
        box.claims = {u for u in box.claims | set(bound) if u in self.rules.claims and u not in others}

    def limit_of(self, box: Box) -> tuple[int, str]:
        """(bytes, source) of a budget: its claims' sum (0 where its containers are bound by
        claims another budget holds), else the rules for the container that names it."""
        claims = self.rules.budget(box.claims)
        if claims is None:
            bound = {u for m in box.members.values() for u in self.rules.binding(m)}
            if bound:
                from .tenants.claims import held_elsewhere
                claims = held_elsewhere(self.rules.claims, bound)
        return self.rules.limit_for(box.container, box.name, box.labels, claims)

    def new_container(self, c: Container):
        """A container seen for the first time: a decision left by a gone one at its cgroup goes."""
        if self.durable.sweep((c.id, c.cgroup)):
            self.decided()

    def set_limit(self, container: str, limit: int, force: bool = False) -> tuple[str, int]:
        """`convgpu limit set`: until the container is gone, beats every other source. A job
        registered by `convgpu run` is found before its first CUDA call too (issue 39 part 4:
        before, "no container is known" until the job had placed a process). Refused (issue
        52): a name several containers answer to, a limit below one context on every GPU, and
        unless `force`, a limit below what the container holds; a DRA claim's budget (issue
        48: its size is the claim's). (name, limit)."""
        c, name, box = self._resolve(container)
        if box is not None and (box.claims or c.kind == "claim"):
            raise ConvgpuError(f"{name} is a DRA claim's budget, shared by {len(box.members)} container(s)",
                               "its size is the claim's consumedCapacity: change the claim")
        self.check_fits(f"the limit of {name}", limit)
        if box is not None and not force:
            self._check_held(box, limit)
        entry = LimitSet(limit, c.cgroup, self.durable.identity(c.cgroup))
        self.durable.commit(self.durable.value.with_limit(c.id, entry), f"the limit of {name}")
        self.decided()
        limit = self.books.capped(name, limit)
        if box is None:
            log.info("limit of %s set to %s (convgpu limit set; no CUDA call yet)", name, format_size(limit))
        else:
            self.apply_limit(box, limit, "convgpu limit set")
        return name, limit

    def _resolve(self, container: str) -> tuple[Container, str, Box | None]:
        """What `container` names: a placed container, or a `convgpu run` job not placed yet;
        KeyError if none, books.Ambiguous if several (placed or not) answer to it."""
        try:
            box = self.books.find(container)
        except KeyError:
            box = None
        waiting = self._registered(container)
        if len(waiting) + (box is not None) > 1:
            ids = ([(box.container.id, box.container.cgroup)] if box else []) + [(cg, cg) for cg in waiting]
            raise Ambiguous(container, ids)
        if box is not None:
            return box.container, box.name, box
        if not waiting:
            raise KeyError(container)
        return container_of_path(waiting[0]), self.names.get(waiting[0]) or waiting[0], None

    def _check_held(self, box: Box, limit: int):
        """A limit below what a container holds stops it at its next call, and the driver's
        count (the backstop) stops it at once: said, and done only when forced."""
        for dev in sorted(box.assigned):
            held = self.books.held(box, dev)
            if limit < held:
                raise ConvgpuError(f"{box.name} holds {format_size(held)} on GPU{dev}, more than {format_size(limit)}: "
                                   "a lower limit stops it until it frees the difference",
                                   f"give at least {format_size(held)}, or add --force")

    def context_below(self, limit: int, gpu: str | None = None) -> dict:
        """GPU -> its context estimate, where `limit` is below it (ctxest.below_context); gpu:
        only the GPU of this key (gpu_key: a Kubernetes grant's)."""
        if self.estimate is None:
            return {}
        return ctxest.below_context(limit, {d: self.estimate(d) for d in sorted(self.books.capacity)
                                            if gpu is None or self.gpu_key(d) == gpu})

    def check_fits(self, what: str, limit: int):
        """Refuses a limit below one context's charge on every GPU (`convgpu run`, `limit set`):
        its job's first CUDA call would wait until the limit is raised (issue 52). Below some
        GPUs only: allowed (context_warning says it)."""
        below = self.context_below(limit)
        if below and len(below) == len(self.books.capacity):
            least = min(e.bytes for e in below.values())
            raise ConvgpuError(ctxest.below_context_text(what, limit, below)
                               + ": its first CUDA call would wait until the limit is raised",
                               f"give at least {format_size(least)} (the context) plus what the job allocates")

    def context_warning(self, what: str, limit: int, gpu: str | None = None) -> str:
        """'' where one context fits `limit` on every GPU (or the one of key `gpu`); else one
        line that says where not."""
        below = self.context_below(limit, gpu)
        return (ctxest.below_context_text(what, limit, below) + ": a process there waits at its first "
                "CUDA call until the limit is raised") if below else ""

    def warn_small_pods(self):
        """The Kubernetes agent's limits no context fits in, each said once in the log: the pod
        was scheduled already, and its containers wait at their first CUDA call (issue 52)."""
        for key, p in sorted(self.rules.pods.items()):
            for gpu, size in p.gpus or ((None, p.bytes),):
                if p.lower_only and not size or (key, gpu, size) in self.said_small:
                    continue
                text = self.context_warning(f"the pod limit of {key} ({p.source})", size, gpu)
                if text:
                    self.said_small.add((key, gpu, size))
                    log.warning("%s", text)

    def warn_small_limits(self):
        """At start and at each reload: every limit of the config's and the command line's that
        no context fits in, in the log at once (its containers would wait at their first call)."""
        r = self.rules
        named = [(f"--limit {k}", v) for k, v in r.explicit.items()]
        named += [(f"config rule #{i} ({x.match} {x.pattern!r})", x.limit) for i, x in enumerate(r.rules, 1)]
        for what, limit in named + [("--default-limit", r.default)]:
            text = self.context_warning(what, limit)
            if text:
                log.warning("%s", text)
        for dev, cap in sorted(self.books.capacity.items()):   # --gpu-memory 4B: nothing fits
            below = self.context_below(cap, self.gpu_key(dev))
            if below:
                log.warning("%s: nothing can run there", ctxest.below_context_text(f"the capacity of GPU{dev}", cap, below))

    def _registered(self, container: str) -> list[str]:
        """The cgroups of `convgpu run` jobs not placed yet that answer to this name or cgroup."""
        placed = {cg for b in self.books.boxes.values() for cg in b.cgroups}
        return [cg for cg, run in sorted(self.durable.value.runs.items())
                if container in (run.name, cg) and cg not in placed]

    def registered(self) -> list[dict]:
        """For status: what has a limit and no placed process yet (no CUDA call so far), each
        with what it is: `convgpu run` jobs ("registered"), the Kubernetes agent's containers and
        pods ("pod"), DRA claims ("claim"). Names come from tenants (a job's owner, a claim's
        name): the views show them as text, never markup."""
        boxes = self.books.boxes.values()
        members = [m for b in boxes for m in (b.container, *b.members.values())]
        placed = {m.cgroup for m in members}
        ids = {m.id for m in members} | {m.pod for m in members if m.pod}
        out = []
        v = self.durable.value
        for cg, run in sorted(v.runs.items()):
            if cg in placed:
                continue
            c = container_of_path(cg)
            limit, source = self.rules.limit_for(c, run.name, None)
            out.append({"id": c.id, "name": run.name or cg, "cgroup": cg, "limit": limit, "source": source,
                        "what": "registered"})
        for key, pod in sorted(v.pods.items()):
            if key not in ids:
                out.append({"id": key, "name": pod.job or key, "cgroup": "", "limit": pod.bytes,
                            "source": pod.source, "what": "pod"})
        for uid, claim in sorted(v.claims.items()):
            if not ids & {*claim.pods, *claim.users, *claim.containers}:
                out.append({"id": uid, "name": claim.ref, "cgroup": "", "limit": claim.bytes,
                            "source": "DRA claim", "what": "claim"})
        return out

    def apply_limit(self, box: Box, limit: int, source: str):
        """A new limit: an over-limit waiter may now fit; a lower one takes effect at the next
        allocation (memory already assigned is not taken back)."""
        if (limit, source) == (box.limit, box.source):
            return
        box.limit, box.source = limit, source
        for dev in box.assigned:
            self.revoke(box, dev)
            box.assigned[dev] = min(box.assigned[dev], max(self.books.limit(box, dev), self.books.demand(box, dev)))
            self.write_assign(box, dev)
            if dev in box.waiting:   # its recheck tells again (with its contexts) if it still cannot fit
                w = box.waiting[dev]
                w.over_limit = w.circular = False
                for a in w.asks.values():
                    a.over_limit, a.said = a.size > limit, False
        log.info("limit of %s set to %s (%s)", box.name, format_size(limit), source)
        self.decider.schedule()

    def register_run(self, cgroup: str, limit: int, name: str | None):
        """`convgpu run`: a cgroup of its own with this limit, before its first CUDA call. The
        cgroup must be there: its id tells this container from a later one at the same path."""
        self.check_fits(f"--limit of {name or cgroup}", limit)
        ident = self.durable.identity(cgroup)
        if ident is None:
            raise ConvgpuError(f"no cgroup {cgroup}", "make it before registering it (convgpu run does)")
        run = Run(limit, name, ident)
        self.durable.commit(self.durable.value.with_run(cgroup, run), f"the registration of {name or cgroup}")
        self.decided()
        log.info("convgpu run: %s (%s) limit %s", name or cgroup, cgroup, format_size(limit))

    def decided(self):
        """The durable decisions into the rules the limits come from (and the names). Where
        the file could not be read at start, every container's limit is unknown: it keeps what
        it holds and is admitted nothing more (new contexts included) until the decisions are
        read again, and --over-limit kill is suspended meanwhile. Fail closed: any container
        may have had a limit set at run time, lower or higher than the rules give, and a job
        limited by a guess could take memory its operator gave to no one (a lower limit
        lost), or, under kill, be killed for a limit it never had. Starting at all keeps the
        card's capacity enforced; refusing to start would leave every call unchecked."""
        v, err = self.durable.value, self.durable.error
        self.rules.runtime = {cid: e.limit for cid, e in v.limits.items()}
        self.rules.runs = {cg: r.limit for cg, r in v.runs.items()}
        self.rules.pods = dict(v.pods)
        self.rules.claims = dict(v.claims)
        self.rules.unreadable = err
        self.names = {cg: r.name for cg, r in v.runs.items() if r.name}
        self.decider.over_limit = "stall" if err else self.over_limit_asked

    def sweep(self, now: float):
        """Entries of containers that are gone leave the file (every SWEEP_EVERY)."""
        if now - self._swept < SWEEP_EVERY:
            return
        self._swept = now
        went = self.durable.sweep()
        if went:
            self.decided()
            log.info("decisions of containers that are gone dropped: %s", ", ".join(went))

    def reload(self) -> bool:
        """SIGHUP / `convgpu reload`: new rules for new containers and for running ones whose
        limit came from a rule, a label or the default. A bad file keeps the last good config.
        A decisions file that could not be read is read again first (repaired or moved aside:
        the held containers get their limits). False: why is in reload_error (`convgpu reload`
        prints it: issue 52)."""
        self.reload_error = ""
        recovered = self._reread_decisions()
        still = f"; the decisions are still unreadable ({self.durable.error})" if self.durable.error else ""
        if self.reload_config is None:
            if recovered:
                self.relimit()
                return True
            self.reload_error = "no config file was given (--config)" + still
            log.warning("reload: %s", self.reload_error)
            return False
        try:
            rules, settings = self.reload_config()
        except ConvgpuError as e:
            self.reload_error = f"{e}{still}"
            log.error("reload failed, keeping the last good config: %s", e)
            if recovered:
                self.relimit()
            return False
        self.rules.take_config(rules)
        self.decided()                     # run-time decisions and the agent's: not the file's
        d = self.decider
        if "policy" in settings and settings["policy"] != d.policy:
            log.info("policy %s -> %s", d.policy, settings["policy"])
            d.policy = settings["policy"]
        d.max_wait = settings.get("max_wait", d.max_wait)
        self.relimit()
        log.info("config reloaded: %d rules, default limit %s", len(rules.rules),
                 format_size(rules.default))
        self.warn_small_limits()
        self.say_unmatched("at reload")
        return True

    def say_unmatched(self, when: str):
        """One line: the --limit keys and [[rule]]s that match no container seen so far (issue
        47: a unit named otherwise than convgpu saw it fell to the default, said nowhere)."""
        left = self.rules.unmatched()
        if left:
            log.info("%s, limits that match no container seen so far: %s (a container is named by its name, "
                     "id, short id or cgroup path; a systemd unit also by its name with or without its suffix, "
                     "victim.service or victim)", when, ", ".join(left))

    def _reread_decisions(self) -> bool:
        """True if a decisions file unreadable until now could be read."""
        if not self.durable.error:
            return False
        if not self.durable.load():
            log.error("decisions still unreadable: %s; every container stays held", self.durable.error)
            return False
        log.info("decisions read again from %s: %s", self.durable.path,
                 ", ".join(f"{n} {k}" for k, n in self.durable.value.counts().items()))
        self.decided()
        self.write_control(True)   # --over-limit kill again, if asked
        return True

    def relimit(self) -> int:
        """Every running container's limit worked out again (a waiter that now fits resumes).
        Returns how many changed."""
        changed = 0
        boxes = sorted(self.books.boxes.values(), key=lambda b: (b.created, b.key))
        for box in boxes:   # unprepared claims go first: the oldest budget takes what is free
            box.claims &= set(self.rules.claims)
        for box in boxes:   # a container the agent matched since binds the claims it uses
            self.take_claims(box, {u for m in box.members.values() for u in self.rules.binding(m)})
        for box in boxes:
            limit, source = self.limit_of(box)
            capped = self.books.capped(box.name, limit)
            if (capped, source) != (box.limit, box.source):
                self.apply_limit(box, capped, source)
                changed += 1
        return changed
