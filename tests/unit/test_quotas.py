"""The Quotas part (enforcer/quotas.py) built alone: plain books, a fake of BpfMaps' bucket side,
and real processes (`sleep`) to stop, resume and kill. No Enforcer, no kernel, no root."""
import logging
import signal
import time
from types import SimpleNamespace

from convgpu.enforcer.books import Books, Box
from convgpu.enforcer.failsafe.stall import _stat
from convgpu.enforcer.quotas import MapQuota, Quotas
from convgpu.enforcer.tenants.containers import Container

GiB = 1 << 30


class Maps:
    """BpfMaps' bucket side: what each container holds against its quotas (set by the test)."""

    def __init__(self):
        self.held: dict[int, dict] = {}
        self.calls: list = []

    def ensure_quota(self, key):
        self.calls.append(("ensure", key))

    def drop_quota(self, key):
        self.calls.append(("drop", key))

    def quota_counts(self, key):
        return {"objects": 0, "threads": 0, "processes": 0, "denied": 0, **self.held.get(key, {})}


def part(over_limit="stall", quota=MapQuota(objects=10, threads=4, processes=2)):
    books = Books({0: 8 * GiB}, {0: 8 * GiB}, lambda box, dev: None, lambda dev: 0, lambda box, dev: box.limit)
    maps = Maps()
    setting = {"over_limit": over_limit}
    return Quotas(maps, books, quota, lambda: setting["over_limit"]), books, maps, setting


def box(books, key, name, pids):
    b = Box(key, Container("cgroup", f"/{name}", f"/{name}"), name, 0.0, GiB, "test", set(pids))
    books.boxes[b.container.id] = books.by_key[key] = b
    return b


def event(pid, key, result=1):
    return SimpleNamespace(pid=pid, addr=key, result=result, api="cuMemAlloc_v2")


def reaches(pid, stopped: bool) -> bool:
    """pid comes to be stopped (or running) within 2 s: a signal lands a little after kill()."""
    for _ in range(400):
        st = _stat(pid, "/proc")
        if st is not None and (st[0] in "Tt") == stopped:
            return True
        time.sleep(0.005)
    return False


def test_a_hit_holds_the_process_until_its_container_has_room_in_every_quota(sleepers, caplog):
    caplog.set_level(logging.INFO, logger="convgpu")
    q, books, maps, _ = part()
    a, other, _ = sleepers
    x = box(books, 7, "tenant", [a.pid])
    maps.held[7] = {"objects": 10, "threads": 1, "processes": 1}
    a.send_signal(signal.SIGSTOP)               # as BPF stopped it at the call's entry
    assert reaches(a.pid, stopped=True)
    q.hit(event(a.pid, 7))
    q.hit(event(a.pid, 7))                      # its recheck stopped it again: said once
    q.hit(event(other.pid, 99))                 # a key of no container: nothing
    assert q.held == {a.pid: 7} and x.quota_hits == 2
    said = [r.message for r in caplog.records if "at its quota" in r.message]
    assert said == [f"container tenant pid {a.pid} at its quota in the BPF maps (objects 10/10, threads 1/4, "
                    "processes 1/2): stopped until its container frees entries before its cuMemAlloc_v2 ran "
                    "(--over-limit stall; the quotas: --max-objects, --max-threads, --max-processes)"]
    assert q.status(x) == {"objects": 10, "threads": 1, "processes": 1, "denied": 0, "hits": 2,
                           "stopped_pids": [a.pid]}
    q.resume_due()                              # still at its object quota: stays
    assert q.held == {a.pid: 7} and _stat(a.pid, "/proc")[0] in "Tt"
    maps.held[7]["objects"] = 9
    q.resume_due()
    assert q.held == {} and reaches(a.pid, stopped=False)


def test_under_kill_or_past_the_thread_quota_nothing_waits():
    q, books, _, setting = part(over_limit="kill")
    box(books, 3, "k", [11])
    q.hit(event(11, 3))
    assert q.held == {}
    setting["over_limit"] = "stall"             # a reload back to stall: a thread past its quota
    q.hit(event(12, 3, result=0))               # was killed by BPF whatever --over-limit says
    assert q.held == {} and books.by_key[3].quota_hits == 2


def test_the_process_quota_stops_a_newcomer_and_kill_kills_it(sleepers):
    a, b, c = sleepers
    q, books, _, setting = part()
    x = box(books, 5, "full", [a.pid, b.pid])
    assert not q.process_full(x, a.pid)         # a member already
    assert q.process_full(x, c.pid) and q.held == {c.pid: 5} and x.quota_hits == 1
    del q.held[c.pid]
    setting["over_limit"] = "kill"
    assert q.process_full(x, c.pid) and q.held == {}
    assert c.wait(timeout=5) == -signal.SIGKILL
    x.pids.discard(b.pid)
    assert not q.process_full(x, c.pid)         # room again: it is placed


def test_a_dead_waiter_is_forgotten_and_a_gone_container_resumes_its_waiter(sleepers):
    a, b, _ = sleepers
    q, books, maps, _ = part()
    x = box(books, 1, "gone", [a.pid])
    q.held = {a.pid: 1, b.pid: 2}               # b's container (key 2) is gone
    b.send_signal(signal.SIGSTOP)
    assert reaches(b.pid, stopped=True)
    maps.held[1] = {"threads": 4}
    a.kill()
    a.wait()
    q.resume_due()
    assert q.held == {} and reaches(b.pid, stopped=False)   # resumed: placed afresh at its next call
    q.ensure(x)
    q.drop(x)
    assert maps.calls == [("ensure", 1), ("drop", 1)]
