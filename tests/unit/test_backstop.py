"""enforcer/backstop.py without a kernel or an enforcer: the driver's count (NVML's per-process
bytes) against each container's limit, and what the backstop does about it, with fakes of what
it is handed (books, stall backend) and real processes (`sleep`) to stop and resume."""
import logging
import subprocess
import time
from dataclasses import dataclass, field

from convgpu.enforcer.backstop import SLACK, Backstop, overs
from convgpu.enforcer.failsafe.stall import SignalStopper, _stat

MiB, GiB = 1 << 20, 1 << 30


def test_overs_sums_each_containers_processes_per_gpu_against_its_limit():
    members = {1: {10, 11}, 2: {20}}
    raw = {(10, 0): 600 * MiB, (11, 0): 500 * MiB, (10, 1): 100 * MiB, (20, 0): 1024 * MiB + SLACK, (99, 0): 8 * GiB}
    limits = {(1, 0): GiB, (1, 1): GiB, (2, 0): GiB}
    assert overs(members, raw, lambda k, d: limits[(k, d)]) == {(1, 0): (1100 * MiB, GiB)}   # 2: within the slack
    assert overs(members, {(20, 0): GiB + SLACK + 1}, lambda k, d: limits[(k, d)]) == {(2, 0): (GiB + SLACK + 1, GiB)}
    assert overs({}, raw, lambda k, d: 0) == {}          # a process of no container is not summed


@dataclass
class Box:
    key: int
    name: str
    pids: set
    container: object = None
    waiting: dict = field(default_factory=dict)
    over_limits: int = 0


class Books:
    def __init__(self, boxes, limits):
        self.boxes, self.limits = {b.key: b for b in boxes}, limits

    def limit(self, box, dev):
        return self.limits[box.key]


def state(p) -> str:
    for _ in range(200):
        st = _stat(p.pid, "/proc")
        if st and st[0] in "Tt":
            return "stopped"
        time.sleep(0.005)
    return _stat(p.pid, "/proc")[0]


def backstop(books, over_limit="stall", place=lambda pid: None, killed=None, whole=frozenset()):
    return Backstop(books, SignalStopper(), place, lambda pid: (killed.append(pid) if killed is not None else None),
                    lambda box, pid: pid in whole, lambda: set(), lambda pid, dev: "calls", lambda: {},
                    lambda: over_limit)


def test_over_stops_every_process_of_it_and_only_it_until_it_fits(sleepers, caplog):
    caplog.set_level(logging.INFO, logger="convgpu")
    a, b, c = sleepers
    books = Books([Box(1, "tenant", {a.pid, b.pid}), Box(2, "neighbour", {c.pid})], {1: 256 * MiB, 2: GiB})
    bs = backstop(books)
    raw = {(a.pid, 0): 200 * MiB, (b.pid, 0): 1024 * MiB, (c.pid, 0): 512 * MiB}
    assert bs.step(raw, 1)
    assert state(a) == state(b) == "stopped" and _stat(c.pid, "/proc")[0] != "T"
    assert bs.status(1, 0, time.monotonic())["over_by"] == 1224 * MiB - 256 * MiB
    assert "container tenant GPU0: over its limit by the driver's count" in caplog.text
    assert books.boxes[1].over_limits == 1 and bs.held()[0] == {a.pid, b.pid}
    assert not bs.step(raw, 1)                       # the same sample is not looked at twice
    subprocess.run(["kill", "-CONT", str(a.pid)])    # a sibling's SIGCONT: stopped again at the next sample
    time.sleep(0.05)
    assert bs.step(raw, 2) and state(a) == "stopped" and "run again while over its limit" in caplog.text
    books.limits[1] = 2 * GiB                        # a raised limit: it fits, both run again
    assert bs.step(raw, 3)
    time.sleep(0.05)
    assert _stat(a.pid, "/proc")[0] != "T" and _stat(b.pid, "/proc")[0] != "T" and bs.over == {}
    assert "fits its limit again" in caplog.text


def test_a_process_bpf_holds_whole_at_a_call_is_left_for_the_decider(sleepers):
    a, b, _ = sleepers
    books = Books([Box(1, "t", {a.pid, b.pid})], {1: 256 * MiB})
    bs = backstop(books, whole={b.pid})
    raw = {(a.pid, 0): GiB}
    bs.step(raw, 1)
    bs.step({(a.pid, 0): 100 * MiB}, 2)               # freed: fits
    time.sleep(0.05)
    assert _stat(a.pid, "/proc")[0] != "T" and state(b) == "stopped"


def test_kill_takes_the_process_holding_most_beyond_its_allocations_until_it_fits(sleepers, caplog):
    a, b, c = sleepers
    books = Books([Box(1, "t", {a.pid, b.pid, c.pid})], {1: GiB})
    killed = []
    bs = Backstop(books, SignalStopper(), lambda pid: None, killed.append, lambda box, pid: False, lambda: set(),
                  lambda pid, dev: "", lambda: {(a.pid, 0): 600 * MiB, (b.pid, 0): 0, (c.pid, 0): 300 * MiB},
                  lambda: "kill")
    # a: 700 MiB of which 600 accounted (100 unexplained); b: 500 MiB, none accounted; c: 300, all accounted
    assert bs.step({(a.pid, 0): 700 * MiB, (b.pid, 0): 500 * MiB, (c.pid, 0): 300 * MiB}, 1)
    assert killed == [b.pid]                          # 1,500 - 500 = 1,000 MiB: fits
    assert f"pid {b.pid} killed" in caplog.text


def test_a_process_never_placed_is_placed_by_what_it_holds_and_gpus_without_counts_are_skipped(sleepers):
    a, b, _ = sleepers
    box = Box(1, "t", set())
    books = Books([box], {1: 256 * MiB})

    def place(pid):
        box.pids.add(pid)
        return box
    bs = backstop(books, place=place)
    bs.off = {1: "MIG mode"}
    assert bs.step({(a.pid, 0): GiB, (b.pid, 1): 8 * GiB}, 1)
    assert box.pids == {a.pid} and state(a) == "stopped"
    # a graphics process (a display server: in no compute list) is never placed by what it holds
    bs.off = {}
    bs.step({(a.pid, 0): GiB, (b.pid, 0): 8 * GiB}, 2, compute={a.pid})
    assert box.pids == {a.pid}


def test_doctor_says_where_the_backstop_is_off_and_why():
    from convgpu.cli.doctor import backstop_check
    from convgpu.probes.nvml import GpuInfo

    class Nv:
        ok, error = True, ""

        def __init__(self, migs=(), fail=None):
            self.migs, self.fail = migs, fail

        def gpus(self):
            return [GpuInfo(0, "H200", 1, 0, "GPU-a", 0, self.migs)]

        def process_memory(self):
            if self.fail:
                raise RuntimeError(self.fail)
            return {}
    assert backstop_check(Nv()).ok and backstop_check(Nv()).detail.startswith("on:")
    assert backstop_check(Nv(migs=("MIG-1",))).detail == "off on GPU0 (MIG mode): NVML counts no process's memory there"
    c = backstop_check(Nv(fail="Not Supported"))
    assert not c.ok and c.detail == "off: NVML gives no per-process memory (Not Supported)"
    nonv = type("N", (), {"ok": False, "error": "NVML Shared Library Not Found"})()
    assert backstop_check(nonv).detail == "off: no NVML (NVML Shared Library Not Found)"
