"""The enforcer's books: per container and device, what it was assigned, holds, reserves and
waits for (Box, Wait, and per stopped thread an Ask), and the sums the decisions read (room,
free, claims). Reads only: the BPF counters through the reader it is given, never a write."""
import logging
import time
from dataclasses import dataclass, field

from ..errors import ConvgpuError
from ..units import format_size
from . import policies
from .tenants.containers import Container

log = logging.getLogger(__package__ + ".daemon")   # the Enforcer logs as one: "daemon: ..." (bench/sched, tests read it)
MASK64 = (1 << 64) - 1
CIRCULAR_S = 3.0   # s without a free in a container whose threads still run, before its waits are circular


@dataclass
class Ask:
    """One call stopped at its entry: a thread's, for `size` bytes (a context: its charge). A
    wait belongs to it, not to its container: it resumes once its own call fits
    (docs/ENFORCE.md, "Waits")."""
    pid: int
    tid: int
    size: int
    since: float
    seq: int = 0              # BPF's stall number (held map): a release names the stop it ends
    over_limit: bool = False  # can never fit: size + what its thread holds + its contexts > the limit (BPF)
    said: bool = False        # logged as over the limit
    first: bool = False       # its process's first context: it was just placed (Decider._settling)
    reserved: bool = False    # stopped again at its recheck, its reservation kept (BPF): in _taken already
    swapin: bool = False      # no stopped thread: a swapped process's footprint, to restore (enforcer/swap/)

    @property
    def need(self) -> int:
        """What it adds to what the container has taken once resumed."""
        return 0 if self.reserved else self.size


@dataclass
class Wait:
    """A container's waits on one device: its stopped threads (asks) and shim requests."""
    since: float
    pids: set[int]
    unreserved: int = 0      # shim requests: not in BPF
    over_limit: bool = False  # every request is over the limit: nothing but a new limit helps
    wakes: list = field(default_factory=list)   # shim waiters: (pid, size, wake(answer))
    asks: dict[int, Ask] = field(default_factory=dict)   # tid -> its stopped call
    circular: bool = False    # no ask fits even in the whole limit, and its own processes hold
    held_was: int = 0         # what the container held when last looked at (a drop: a free)
    freed_at: float = 0.0     # when it last dropped (or the wait began)

    @property
    def asked(self) -> int:
        return sum(a.need for a in self.asks.values())


@dataclass
class Exit:
    """A process that exited and whose memory the driver may still hold (until its pidfd fires)."""
    pid: int
    until: float                 # give up waiting then (a pid reused meanwhile never fires it)
    held: dict[int, int]         # device -> bytes, against the card's room
    box: "Box | None" = None     # its container, and per device what BPF moved to its tearing
    charge: dict[int, int] = field(default_factory=dict)


@dataclass
class Box:
    """A budget under enforcement: a container's own, or a DRA claim's, which every container
    that uses the claim shares (issue 48: one entry in the books, one key in BPF's maps, stalled
    together, one row in `status`). `container` names it (a claim's: kind "claim", no cgroup of
    its own); `members` are the containers whose processes it holds, each with its cgroup."""
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
    over_limits: int = 0
    circulars: int = 0
    restalls: int = 0
    quota_hits: int = 0      # calls stopped (or killed) at a quota in the BPF maps (enforcer/quotas.py)
    extra: dict[int, int] = field(default_factory=dict)      # device -> measured overhead beyond the charge
    labels: dict | None = None
    adopted: dict[int, tuple[int, int]] = field(default_factory=dict)  # device -> (bytes, contexts)
    shim_pending: dict[int, int] = field(default_factory=dict)  # device -> granted to the shim, not yet allocated
    torn: dict[int, int] = field(default_factory=dict)   # device -> cgstate.tearing the driver has freed
    placed: dict[int, float] = field(default_factory=dict)   # pid -> when its first context was admitted
    settling: set[int] = field(default_factory=set)   # pids whose first context was said to wait (Decider._settling)
    # device -> tid -> an Ask resumed alone whose thread has not passed its recheck yet (where
    # BPF reserves its size again): counted as taken meanwhile, so a second resume cannot
    # count on the same room (decisions._serve; dropped once BPF's `held` forgets that stop)
    going: dict[int, dict] = field(default_factory=dict)
    members: dict[str, Container] = field(default_factory=dict)   # container id -> the container
    of_pid: dict[int, str] = field(default_factory=dict)           # pid -> its member's id
    claims: set = field(default_factory=set)   # uids of the DRA claims whose budget this is (tenants/claims.py)

    @property
    def cgroups(self) -> tuple[str, ...]:
        """The cgroups of its members (what a freezer stall freezes), its own where none is known."""
        got = sorted({m.cgroup for m in self.members.values() if m.cgroup})
        return tuple(got) if got or not self.container.cgroup else (self.container.cgroup,)

    def add(self, pid: int, c: Container | None):
        """pid is one of its processes, in container c (None: not known, its own)."""
        c = c or self.container
        self.pids.add(pid)
        self.members.setdefault(c.id, c)
        self.of_pid[pid] = c.id

    def drop(self, pid: int) -> Container | None:
        """pid left; the member it was in if that was its last process (the member goes)."""
        self.pids.discard(pid)
        cid = self.of_pid.pop(pid, None)
        if cid is None or cid in self.of_pid.values():
            return None
        return self.members.pop(cid, None)

    def member_pids(self, cid: str) -> list[int]:
        return sorted(p for p, m in self.of_pid.items() if m == cid)


class Ambiguous(ConvgpuError):
    """A name (or prefix) that several containers answer to: which one is meant is the
    operator's to say, by an id."""

    def __init__(self, name: str, ids: list[tuple[str, str]]):
        super().__init__(f"{name!r} names {len(ids)} containers: "
                         + ", ".join(f"id {cid} (cgroup {cg})" if cg != cid else f"id {cid}" for cid, cg in ids),
                         "give one of their ids (`convgpu status` shows them)")
        self.ids = [cid for cid, _ in ids]


class Books:
    """The enforcer's books: what each container was assigned, holds, reserves and waits for
    per device (Box, Wait, Ask, Exit: plain data), which container each process is in, and the
    sums the decisions read (room, free, claims). Built from its readers, so the books can be
    built and decided on without an Enforcer or a kernel (tests/unit/test_books.py):
    state_of(box, dev): BPF's counters for a container on a device (cgstate), or None;
    ctx_of(dev): the bytes a context is charged until NVML measures it;
    share_of(box, dev): its limit on that GPU (its own, or its pod's share: LimitRules.share);
    whole(pid): a stop holds every thread of pid (ptrace refused, or one thread);
    freezer: stops hold whole containers (the cgroup freezer), not threads.
    Reads only: the BPF counters through state_of, never a write."""

    def __init__(self, capacity: dict[int, int], physical: dict[int, int], state_of, ctx_of, share_of,
                 whole=lambda pid: True, freezer: bool = False):
        self.capacity, self.physical = capacity, physical
        self.state_of, self.ctx_of, self.share_of, self.whole, self.freezer = state_of, ctx_of, share_of, whole, freezer
        self.boxes: dict[str, Box] = {}
        self.by_key: dict[int, Box] = {}
        self.pid_box: dict[int, Box] = {}   # each placed process's container
        self.shimmed: set[int] = set()      # pids under the preload shim: they wait, never stop
        self.exits: dict[int, Exit] = {}   # pidfd -> an exited process the driver may still hold memory of
        # pid -> a member that exited (Exits), whose container keeps what NVML still lists under
        # its pid (enforcer/attribution.py: the backstop prunes it once NVML lists it no more)
        self.departed: dict = {}
        self.orphaned: dict[str, dict[int, int]] = {}   # container id -> GPU -> what its gone members left (backstop)
        self.unattributed: dict[int, int] = {}          # GPU -> memory no one can be shown to hold (backstop)
        # container id -> GPU -> what its swapped processes were charged there: in host memory
        # now, so not on the GPU (enforcer/swap/swapper.py writes it); and those processes' pids
        self.swapped: dict[str, dict[int, int]] = {}
        self.swapped_pids: set[int] = set()
        self.next_key = 1                   # a container's key in BPF's maps: never one used before

    def new_key(self) -> int:
        key, self.next_key = self.next_key, self.next_key + 1
        return key

    def waiters(self) -> int:
        """(container, device) waits: BPF wakes the loop at frees and exits only while there are."""
        return sum(len(b.waiting) for b in self.boxes.values())

    def waits_whole(self, box: Box, pid: int) -> bool:
        """pid is stopped at a call BPF holds, its whole process stopped with it: a SIGCONT
        would let it into its call (its recheck would stop it again), so the decider resumes it."""
        return any(a.pid == pid for w in box.waiting.values() for a in w.asks.values()) and self.whole(pid)

    def limit(self, box: Box, dev: int) -> int:
        """L_c on one GPU: the container's limit, or where its pod's grant spans GPUs, the
        pod's share on this one (the Kubernetes agent's split, docs/KUBERNETES.md)."""
        return self.share_of(box, dev)

    def usage(self, box: Box, dev: int) -> tuple[int, int, int]:
        """(live bytes, contexts, reserved) of a container on a device: BPF's counters plus
        what was adopted at placement (BPF's `used` may have wrapped below zero: see charged()
        in bpf/books.bpf.c)."""
        s = self.state_of(box, dev)
        nbytes, nctx = box.adopted.get(dev, (0, 0))
        if s is None:
            return nbytes, nctx, 0
        # an exited process's charge stays until the driver freed it (bpf process_gone)
        tearing = max(0, s.tearing - box.torn.get(dev, 0))
        return (s.used + nbytes + tearing) & MASK64, max(s.contexts + nctx, 0), s.reserved

    def demand(self, box: Box, dev: int) -> int:
        """U_c plus what is pending: everything the container needs to run on (every stopped
        call: BPF holds no reservation for them)."""
        w = box.waiting.get(dev)
        return self.taken(box, dev) + (w.unreserved + w.asked if w else 0)

    def taken(self, box: Box, dev: int) -> int:
        """What the container holds and its calls in flight have reserved: what a resume
        must fit beside (BPF's charged() + reserved), with the calls resumed that have not
        reserved yet (they do at their recheck: Box.going)."""
        used, contexts, reserved = self.usage(box, dev)
        return (self.ctx_held(box, dev, used, contexts) + reserved + box.shim_pending.get(dev, 0)
                + sum(a.need for a in box.going.get(dev, {}).values()))

    def ctx_held(self, box: Box, dev: int, used: int, contexts: int) -> int:
        """used plus its contexts: the estimate each, turned into NVML's measurement for the
        measured ones by box.extra, and what its gone members left (never below zero, as
        charged() in bpf/books.bpf.c, which is written the same sum: beyond)."""
        return max(0, used + contexts * self.ctx_of(dev) + self.beyond(box, dev))

    def beyond(self, box: Box, dev: int) -> int:
        """What the container holds beyond its processes' tracked bytes and contexts at the
        estimate: NVML's measured overhead (box.extra) and what its gone members left (the
        backstop: memory that outlived its process stays its container's), less what its
        swapped processes were charged (in host memory now: enforcer/swap/)."""
        cid = box.container.id
        return box.extra.get(dev, 0) + self.orphaned.get(cid, {}).get(dev, 0) - self.swapped.get(cid, {}).get(dev, 0)

    def held(self, box: Box, dev: int) -> int:
        """What the container holds now: its demand less the requests it is stopped at."""
        used, contexts, _ = self.usage(box, dev)
        return self.ctx_held(box, dev, used, contexts) + box.shim_pending.get(dev, 0)

    def tearing(self, dev: int) -> int:
        """Bytes of exited processes that the driver has not freed yet, where no container
        holds them any more (its last process went: its assignment is back in the pool); a
        live container's are in its own usage (cgstate.tearing)."""
        return sum(x.held.get(dev, 0) for x in self.exits.values() if x.box is None or x.box.key not in self.by_key)

    def assigned(self, dev: int) -> int:
        return sum(b.assigned.get(dev, 0) for b in self.boxes.values())

    def committed(self, dev: int) -> int:
        """What containers hold or may take on dev: each its assignment, or what it holds where
        that is more (memory obtained by calls no admission sized, as NVML measured it: issue
        39). Nobody is granted memory that is not there."""
        boxed = {b.container.id for b in self.boxes.values() if dev in b.assigned}
        return (sum(max(b.assigned[dev], self.held(b, dev)) for b in self.boxes.values() if dev in b.assigned)
                + sum(per.get(dev, 0) for cid, per in self.orphaned.items() if cid not in boxed))

    def room(self, dev: int) -> int:
        """The card's physical room once every container fills its assignment, with what
        exiting processes still hold and what nobody can be shown to hold: a resume needs it
        >= 0 (a grant, too, after it)."""
        return self.physical.get(dev, 0) - self.committed(dev) - self.tearing(dev) - self.unattributed.get(dev, 0)

    def free(self, dev: int) -> int:
        """What may be assigned on dev: the capacity's unassigned memory (less what nobody can
        be shown to hold: issue 47), within the room."""
        return max(0, min(self.capacity.get(dev, 0) - self.committed(dev) - self.unattributed.get(dev, 0),
                          self.room(dev)))

    def claims(self, dev: int, but: Box | None = None) -> list[policies.Claim]:
        """The banker's view of dev (policies.schedule says why): a running container holds its
        assignment (it allocates up to it without asking), a waiter what it uses (its unused
        assignment can be reclaimed), a waiter over its limit the same, for good (stuck)."""
        out = []
        for b in self.boxes.values():
            if dev not in b.assigned or b is but:
                continue
            held = self.held(b, dev)
            w = b.waiting.get(dev) if self.paused(b, dev) else None
            out.append(policies.Claim(b.container.id, self.limit(b, dev),
                                      max(held, b.assigned[dev]) if w is None else held,
                                      stuck=w is not None and (w.over_limit or w.circular)))
        return out

    def paused(self, box: Box, dev: int, now: float | None = None) -> bool:
        """The container cannot go on by itself on dev: every process of it waits (a stopped
        call or a shim request) and none runs a thread that could free. A container with a
        process still running may allocate up to its assignment (issue 23: waits are per
        process and thread, so a container can be both). Where a waiting process's other
        threads run (a thread held alone), they may free at any moment: it counts as paused
        only once none of them freed anything for CIRCULAR_S (the eight-thread run on the H100
        was called deadlocked, and its unused assignment reclaimed, while its threads took
        turns)."""
        w = box.waiting.get(dev)
        if w is None or not box.pids <= w.pids:
            return False
        return self.stopped_whole(box, w) or (now or time.monotonic()) - w.freed_at >= CIRCULAR_S

    def stopped_whole(self, box: Box, w: Wait) -> bool:
        """Every process of the container is stopped with all its threads: the freezer, or
        each one at a call and held whole (ptrace refused, or a single thread)."""
        if self.freezer:
            return True
        asking = {a.pid for a in w.asks.values()}
        return box.pids <= asking and all(self.whole(p) for p in box.pids)

    def member_box(self, cid: str) -> Box | None:
        """The budget a container's processes are charged to, if any of them is placed."""
        return next((b for b in self.boxes.values() if cid in b.members), None)

    def find(self, container: str) -> Box:
        """The one budget a name, id, short id, cgroup or id prefix (6+ characters) names: its
        own, or one of its containers' (a DRA claim's budget holds several). Two containers may
        share a name (two `convgpu run --name job`): a name that matches several is an error
        listing their ids, never the first one found (issue 52)."""
        def answers(b: Box, exact: bool) -> bool:
            return any(container in (b.name, c.id, c.short, c.cgroup) if exact
                       else len(container) >= 6 and c.id.startswith(container)
                       for c in (b.container, *b.members.values()))
        for exact in (True, False):
            found = [b for b in self.boxes.values() if container and answers(b, exact)]
            if len(found) > 1:
                raise Ambiguous(container, [(b.container.id, b.container.cgroup) for b in found])
            if found:
                return found[0]
        raise KeyError(container)

    def capped(self, name: str, limit: int) -> int:
        cap = max(self.capacity.values())
        if limit > cap:
            log.warning("container %s: limit %s above capacity %s: capped", name,
                        format_size(limit), format_size(cap))
        return min(limit, cap)
