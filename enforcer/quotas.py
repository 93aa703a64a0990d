"""Per-container quotas on the BPF maps (issue 24 row 4). BPF counts every entry a container's
processes hold in `objs`, `threads` and `procs` in the container's bucket (`quotas`, keyed like
`members`); a container at a quota is stopped (or killed, --over-limit kill) at the entry of
its call, before the call runs, and never another container (bpf/admit.bpf.c, quota_ok).
This part of the enforcer makes and removes the buckets with the containers, says each hit in
one log line, and resumes a stopped process once its container has room again."""
import contextlib
import logging
import os
import signal
from dataclasses import dataclass

from .actuator import alive
from .books import Box

log = logging.getLogger(__package__ + ".daemon")   # the Enforcer logs as one: "daemon: ..."


@dataclass(frozen=True)
class MapQuota:
    """Entries one container may hold. Defaults: a PyTorch process holds hundreds to a few
    thousand device objects (its caching allocator asks the driver for 2 MiB and larger
    segments, so even 80 GiB in 2 MiB segments is 40,960), a CuPy process without its pool one
    per array; 16,384 objects, 4,096 threads and 1,024 processes fit real jobs many times and
    let 16 containers sit at every quota at once in maps sized 262,144 / 65,536 / 65,536."""
    objects: int = 16384
    threads: int = 4096
    processes: int = 1024

    def leaf(self) -> dict:
        return {"max_objs": self.objects, "max_threads": self.threads, "max_procs": self.processes}


class Quotas:
    """The buckets, and who waits at a quota. Handed BpfMaps (the buckets' writer), the books
    (containers by key), the quotas, and over_limit() ("stall" | "kill": the decider's, which a
    reload may change)."""

    def __init__(self, maps, books, quota: MapQuota, over_limit):
        self.maps, self.books, self.quota, self.over_limit = maps, books, quota, over_limit
        self.held: dict[int, int] = {}   # pid -> container key: stopped at a quota

    def ensure(self, box: Box):
        """Before the container's first `members` entry: BPF counts in buckets that exist."""
        self.maps.ensure_quota(box.key)

    def drop(self, box: Box):
        self.maps.drop_quota(box.key)

    def counts(self, box: Box) -> dict:
        """What the container holds against its quotas now (objects its exited processes left
        count until the tracer's sweep deletes them)."""
        return self.maps.quota_counts(box.key)

    def hit(self, e):
        """BPF stopped (or killed) pid at the entry of a call: its container is at a quota."""
        box = self.books.by_key.get(e.addr)
        if box is None:
            return
        box.quota_hits += 1
        n = self.counts(box)
        q = self.quota
        # result 0: BPF killed it whatever --over-limit says: a thread past the thread quota has
        # no entry, so its call could never be checked or accounted later (bpf stop_then_tell)
        killed = self.over_limit() == "kill" or e.result == 0
        what = ("killed (a thread past its container's thread quota: its call cannot be tracked)" if e.result == 0
                else "killed" if killed else "stopped until its container frees entries")
        if e.pid not in self.held or killed:
            log.warning("container %s pid %d at its quota in the BPF maps (objects %d/%d, threads %d/%d, "
                        "processes %d/%d): %s before its %s ran (--over-limit %s; the quotas: --max-objects, "
                        "--max-threads, --max-processes)", box.name, e.pid, n["objects"], q.objects, n["threads"],
                        q.threads, n["processes"], q.processes, what, e.api, self.over_limit())
        if not killed:
            self.held[e.pid] = box.key

    def process_full(self, box: Box, pid: int) -> bool:
        """A process to place in a container that has --max-processes already: not placed (no
        `members` entry, which BPF would need room for), but stopped (BPF stopped it at its first
        call) or killed, as at any quota; placed once one of them exits."""
        if pid in box.pids or len(box.pids) < self.quota.processes:
            return False
        box.quota_hits += 1
        kill = self.over_limit() == "kill"
        if pid not in self.held:
            log.warning("container %s pid %d: the container has %d processes, its quota (--max-processes): %s",
                        box.name, pid, len(box.pids), "killed" if kill else "stopped until one exits")
        if kill:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        else:
            self.held[pid] = box.key
        return True

    def resume_due(self):
        """SIGCONT whoever waits at a quota once its container has room in every one; BPF's
        recheck lets its call run only then (else it is stopped again)."""
        for pid, key in list(self.held.items()):
            box = self.books.by_key.get(key)
            if not alive(pid):
                del self.held[pid]
                continue
            n = self.counts(box) if box is not None else None
            if n is None or (n["objects"] < self.quota.objects and n["threads"] < self.quota.threads
                             and max(n["processes"], len(box.pids - {pid})) < self.quota.processes):
                del self.held[pid]   # its container gone: resumed, it is placed afresh
                log.info("pid %d%s: room under its quotas again: resumed", pid, f" of {box.name}" if box else "")
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGCONT)

    def status(self, box: Box) -> dict:
        return {**self.counts(box), "hits": box.quota_hits,
                "stopped_pids": sorted(p for p, k in self.held.items() if k == box.key)}
