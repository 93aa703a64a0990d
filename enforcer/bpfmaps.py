"""BPF's maps as the enforcer reads and writes them: the one module of the enforcer that writes a
map the probes read (bpf/maps.bpf.c declares them; docs/DESIGN.md names each map's owner). The
parts decide what goes in (Admission the control map's fields, the decider and ContextCharge an
assignment, Placement a membership, Quotas a bucket); this module only knows the layouts.

The same calls work on the ledger's dict tables (probes/ledger.py, `--no-probes`)."""
import contextlib
import ctypes as ct
import logging
import threading
import time

from ..probes.discovery import HELD_OPEN
from ..probes.ledger import SHIM_MEMBER
from . import devattrs
from .books import Box

log = logging.getLogger(__package__ + ".daemon")   # the Enforcer logs as one: "daemon: ..."


def cgstate_reader(tracer):
    """(box, dev) -> BPF's counters for a container on a device (`cgstate`), or None: the books'
    reader (Books.state_of). A read: it may sit outside BpfMaps."""
    def state(box: Box, dev: int):
        t = tracer.b[b"cgstate"]
        try:
            return t[t.Key(container=box.key, dev=dev)]
        except KeyError:
            return None
    return state


class BpfMaps:
    """Handed the tracer (whose loaded program holds the maps) and the figures an assignment
    carries: limit_of(box, dev) (Books.limit), ctx_of(dev) (what a context is charged) and
    beyond(box, dev) (Books.beyond: measured overhead and what gone members left)."""

    def __init__(self, tracer, limit_of, ctx_of, beyond):
        self.tracer, self.limit_of, self.ctx_of, self.beyond = tracer, limit_of, ctx_of, beyond
        self.lock = threading.Lock()   # the loop, the heartbeat and a measurement's thread write control
        self.leaf: dict = {}           # control's fields but the heartbeat and `measuring` (Admission's)
        self.measuring = 0             # the context measurement's child: admission skips it

    def table(self, name: str):
        return self.tracer.b[name.encode()]

    # ---- control: admission's switches and the heartbeat ----
    def write_control(self, leaf: dict):
        with self.lock:
            self.leaf = leaf
        self.beat()

    def beat(self):
        """The latest fields with a fresh heartbeat: read under the lock, so the heartbeat
        thread never writes back fields older than the loop's last write."""
        with self.lock:
            t = self.table("control")
            t[ct.c_int(0)] = t.Leaf(heartbeat_ns=time.monotonic_ns(), measuring=self.measuring, **self.leaf)

    def set_measuring(self, pid: int, on: bool):
        """Admission skips the measuring child (control.measuring), from the measurement's thread."""
        with self.lock:
            if not on and self.measuring != pid:
                return     # a late thread: another child is exempt by now
            self.measuring = pid if on else 0
        if self.tracer.b is not None and self.leaf:   # else the loop's first write carries it
            self.beat()

    # ---- a container's entries: assign, cgstate, members, quotas ----
    def write_assign(self, box: Box, dev: int):
        t = self.table("assign")
        nbytes, nctx = box.adopted.get(dev, (0, 0))
        t[t.Key(container=box.key, dev=dev)] = t.Leaf(limit=self.limit_of(box, dev), assigned=box.assigned[dev],
                                                      extra_overhead=self.beyond(box, dev),
                                                      adopted=nbytes, adopted_contexts=nctx,
                                                      ctx_charge=self.ctx_of(dev), torn=box.torn.get(dev, 0))

    def ensure_state(self, box: Box, dev: int):
        """BPF charges a container's bytes on a device once this entry exists (never reset:
        a shim process may have been charged before the device was assigned)."""
        st = self.table("cgstate")
        k = st.Key(container=box.key, dev=dev)
        try:
            st[k]
        except KeyError:
            st[k] = st.Leaf()

    def set_member(self, pid: int, key: int, shim: bool = False):
        """pid's calls are charged to container `key`; shim: under the preload shim (BPF does not
        stop the calls it makes from inside a shim wrapper below its limit)."""
        self.table("members")[ct.c_uint(pid)] = ct.c_ulonglong(key | SHIM_MEMBER if shim else key)

    def ensure_quota(self, key: int):
        """Before the container's first `members` entry: BPF counts in buckets that exist."""
        t = self.table("quotas")
        k = ct.c_ulonglong(key)
        try:
            t[k]
        except KeyError:
            t[k] = t.Leaf()

    def quota_counts(self, key: int) -> dict:
        """What the container holds against its quotas now (objects its exited processes left
        count until the tracer's sweep deletes them)."""
        try:
            q = self.table("quotas")[ct.c_ulonglong(key)]
        except KeyError:
            return {"objects": 0, "threads": 0, "processes": 0, "denied": 0}
        try:
            gone = self.table("swept")[ct.c_ulonglong(key)].value
        except KeyError:
            gone = 0
        return {"objects": q.objs - gone, "threads": q.threads, "processes": q.procs, "denied": q.denied}

    def drop_container(self, box: Box):
        """Its last process went: its assignment and counters leave BPF."""
        for dev in box.assigned:
            for name in ("assign", "cgstate"):
                t = self.table(name)
                with contextlib.suppress(KeyError):
                    del t[t.Key(container=box.key, dev=dev)]

    def drop_quota(self, key: int):
        for name in ("quotas", "swept"):
            with contextlib.suppress(KeyError):
                del self.table(name)[ct.c_ulonglong(key)]

    def take_torn(self, gen: int) -> tuple[int, dict[int, int]]:
        """What BPF moved to an exited process's container's `tearing`: (the container's key,
        per device; 0 and {} if nothing), read once: the entry of its generation goes."""
        t = self.table("gone")
        k = ct.c_ulonglong(gen)
        try:
            g = t[k]
            del t[k]
        except KeyError:
            return 0, {}
        return g.container, {d: c for d, c in enumerate(g.charge) if c}

    def gone_entries(self) -> set[int]:
        """The generations in `gone`: exits whose charge nobody took yet (take_torn)."""
        return {k.value for k in self.table("gone").keys()}

    def set_swapped(self, pid: int, on: bool):
        """bpf/swap.bpf.c `swapped`: pid's next call through a touch probe is told (once)."""
        t = self.table("swapped")
        if on:
            t[ct.c_uint(pid)] = ct.c_ulonglong(0)
        else:
            with contextlib.suppress(KeyError):
                del t[ct.c_uint(pid)]

    def stopped_unplaced(self) -> set[int]:
        """Processes BPF stopped at a call (in `held` with no HELD_OPEN bit: an open held by
        discovery is the tracer's to resume)."""
        return {k.value >> 32 for k, v in self.table("held").items() if not v.value & HELD_OPEN}

    def write_resident(self, threads: dict[int, int | None]):
        devattrs.write(self.tracer.b, threads)

    # ---- a take-over (failsafe/adopt.py): the pinned maps of the enforcer before us ----
    def live_members(self, alive) -> dict[int, set[int]]:
        """Container key -> its pids still alive; a dead one's `members` entry goes."""
        members = self.table("members")
        pids: dict[int, set[int]] = {}
        for k, v in list(members.items()):
            if alive(k.value):
                pids.setdefault(v.value & ~SHIM_MEMBER, set()).add(k.value)
            else:
                del members[k]
        return pids

    def prune(self, keys: set[int]):
        """Entries of containers not in `keys` (gone meanwhile) leave assign, cgstate and the
        map quota buckets."""
        for name in ("assign", "cgstate"):
            t = self.table(name)
            for k, _ in list(t.items()):
                if k.container not in keys:
                    del t[k]
        for name in ("quotas", "swept"):
            t = self.table(name)
            for k in [k for k in t.keys() if k.value not in keys]:
                del t[k]

    def assignments(self) -> list:
        """(key, leaf) of every `assign` entry: key.container, key.dev."""
        return list(self.table("assign").items())


def held_seq(held):
    """(pid, tid) -> the number of the stop BPF lists that thread with in `held` (an admission
    stop), None if none. For the ptrace holder's thread: the table object is made here, in the
    loop's thread, and each call is one map lookup."""
    def seq(pid: int, tid: int) -> int | None:
        try:
            v = held[ct.c_ulonglong(pid << 32 | tid)].value
        except KeyError:
            return None
        return None if v & HELD_OPEN else v & 0xFFFFFFFF
    return seq
