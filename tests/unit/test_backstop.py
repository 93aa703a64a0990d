"""enforcer/backstop.py without a kernel or an enforcer: the driver's count (NVML's per-process
bytes) against each container's limit, and what the backstop does about it, with fakes of what
it is handed (books, stall backend) and real processes (`sleep`) to stop and resume."""
import logging
import subprocess
import time
from dataclasses import dataclass, field

from convgpu.enforcer.attribution import DEPARTED_GRACE, Attribution, Departed, Proof
from convgpu.enforcer.backstop import SLACK, Backstop, overs
from convgpu.enforcer.failsafe.stall import SignalStopper, _stat

MiB, GiB = 1 << 20, 1 << 30


def test_overs_is_each_container_above_its_limit_by_more_than_the_slack():
    held = {("a", 0): 1100 * MiB, ("a", 1): 100 * MiB, ("b", 0): 1024 * MiB + SLACK, ("c", 0): 8 * GiB}
    limits = {("a", 0): GiB, ("a", 1): GiB, ("b", 0): GiB}
    assert overs(held, lambda c, d: limits.get((c, d))) == {("a", 0): (1100 * MiB, GiB)}   # b: within the slack
    assert overs({("b", 0): GiB + SLACK + 1}, lambda c, d: limits[(c, d)]) == {("b", 0): (GiB + SLACK + 1, GiB)}
    assert overs(held, lambda c, d: None) == {}        # no limit known: nothing to act on


@dataclass(frozen=True)
class Container:
    id: str
    cgroup: str
    kind: str = "podman"


@dataclass
class Box:
    key: int
    name: str
    pids: set
    container: Container = None
    waiting: dict = field(default_factory=dict)
    assigned: dict = field(default_factory=lambda: {0: 0})
    over_limits: int = 0

    def __post_init__(self):
        self.container = self.container or Container(self.name, "/" + self.name)

    @property
    def cgroups(self):
        return (self.container.cgroup,)


class Books:
    def __init__(self, boxes, limits):
        self.boxes = {b.container.id: b for b in boxes}
        self.limits = limits
        self.departed, self.orphaned, self.unattributed = {}, {}, {}

    @property
    def pid_box(self):
        return {p: b for b in self.boxes.values() for p in b.pids}

    def limit(self, box, dev):
        return self.limits[box.key]

    def member_box(self, cid):
        return self.boxes.get(cid)


def state(p) -> str:
    for _ in range(200):
        st = _stat(p.pid, "/proc")
        if st and st[0] in "Tt":
            return "stopped"
        time.sleep(0.005)
    return _stat(p.pid, "/proc")[0]


def running(p) -> bool:
    """Not stopped, looked at over 0.1 s (a stop lands 30-75 us after the signal)."""
    for _ in range(20):
        if _stat(p.pid, "/proc")[0] in "Tt":
            return False
        time.sleep(0.005)
    return True


def proof(holding=()):
    """Processes in `holding` have GPU 0's node (minor 0) open; no one else has any."""
    return Proof({0: 0}, major=195, opened=lambda pid, major: {0} if pid in holding else set())


def backstop(books, over_limit="stall", place=lambda pid, dev: None, killed=None, whole=frozenset(), holding=(),
             container_of=None, procs=lambda cg: set(), saved=None, accounted=lambda: {}):
    return Backstop(books, SignalStopper(), Attribution(proof(holding)), place,
                    lambda pid: (killed.append(pid) if killed is not None else None),
                    lambda box, pid: pid in whole, lambda: set(), lambda pid, dev: "calls", accounted,
                    lambda: over_limit, container_of or (lambda pid: Container("ctr", "/ctr")), procs,
                    saved or (lambda: None), lambda box, dev: None)


def test_over_stops_every_process_of_it_and_only_it_until_it_fits(sleepers, caplog):
    caplog.set_level(logging.INFO, logger="convgpu")
    a, b, c = sleepers
    books = Books([Box(1, "tenant", {a.pid, b.pid}), Box(2, "neighbour", {c.pid})], {1: 256 * MiB, 2: GiB})
    stopped_at_save = []
    bs = backstop(books, saved=lambda: stopped_at_save.append([_stat(p.pid, "/proc")[0] for p in (a, b)]))
    raw = {(a.pid, 0): 200 * MiB, (b.pid, 0): 1024 * MiB, (c.pid, 0): 512 * MiB}
    assert bs.step(raw, 1)
    assert state(a) == state(b) == "stopped" and running(c)
    # the watchdog's state file was written before the stop (a death right after it resumes them)
    assert stopped_at_save and all(x not in "Tt" for x in stopped_at_save[0])
    assert bs.status("tenant", 0, time.monotonic())["over_by"] == 1224 * MiB - 256 * MiB
    assert "container tenant GPU0: over its limit by the driver's count" in caplog.text
    assert books.boxes["tenant"].over_limits == 1 and bs.held()[0] == {a.pid, b.pid}
    assert not bs.step(raw, 1)                       # the same sample is not looked at twice
    subprocess.run(["kill", "-CONT", str(a.pid)])    # a sibling's SIGCONT: stopped again at the next sample
    time.sleep(0.05)
    assert bs.step(raw, 2) and state(a) == "stopped" and "run again while over its limit" in caplog.text
    books.limits[1] = 2 * GiB                        # a raised limit: it fits, both run again
    assert bs.step(raw, 3)
    assert running(a) and running(b) and bs.over == {}
    assert "fits its limit again" in caplog.text


def test_a_process_bpf_holds_whole_at_a_call_is_left_for_the_decider(sleepers):
    a, b, _ = sleepers
    books = Books([Box(1, "t", {a.pid, b.pid})], {1: 256 * MiB})
    bs = backstop(books, whole={b.pid})
    bs.step({(a.pid, 0): GiB}, 1)
    bs.step({(a.pid, 0): 100 * MiB}, 2)               # freed: fits
    assert running(a) and state(b) == "stopped"


def test_kill_takes_the_process_holding_most_beyond_its_allocations_until_it_fits(sleepers, caplog):
    a, b, c = sleepers
    books = Books([Box(1, "t", {a.pid, b.pid, c.pid})], {1: GiB})
    killed = []
    bs = backstop(books, "kill", killed=killed,
                  accounted=lambda: {(a.pid, 0): 600 * MiB, (b.pid, 0): 0, (c.pid, 0): 300 * MiB})
    # a: 700 MiB of which 600 accounted (100 unexplained); b: 500 MiB, none accounted; c: 300, all accounted
    assert bs.step({(a.pid, 0): 700 * MiB, (b.pid, 0): 500 * MiB, (c.pid, 0): 300 * MiB}, 1)
    assert killed == [b.pid]                          # 1,500 - 500 = 1,000 MiB: fits
    assert f"pid {b.pid} killed" in caplog.text


def test_a_stray_that_proves_it_holds_the_memory_is_placed_and_gpus_without_counts_are_skipped(sleepers):
    a, b, _ = sleepers
    box = Box(1, "t", set())
    books = Books([box], {1: 256 * MiB})

    def place(pid, dev):
        box.pids.add(pid)
        return box
    bs = backstop(books, place=place, holding={a.pid, b.pid}, container_of=lambda pid: box.container)
    bs.off = {1: "MIG mode"}
    assert bs.step({(a.pid, 0): GiB, (b.pid, 1): 8 * GiB}, 1)
    assert box.pids == {a.pid} and state(a) == "stopped" and books.unattributed == {}


def test_a_pid_that_cannot_show_it_holds_the_memory_is_never_placed_stopped_or_killed(sleepers, caplog):
    """Issue 47 finding 1: NVML lists memory under a pid that names a process with no GPU node
    open (a reused pid, a `sleep` of another tenant): unattributed, counted against the GPU."""
    a, b, _ = sleepers
    placed = []
    for mode in ("stall", "kill"):
        killed = []
        bs = backstop(Books([], {}), mode, place=lambda pid, dev: placed.append(pid), killed=killed, holding={b.pid})
        books = bs.books
        bs.step({(a.pid, 0): 3 * GiB}, 1)
        assert placed == [] and killed == [] and running(a)
        assert books.unattributed == {0: 3 * GiB}
        assert f"GPU0: pid {a.pid} is listed by NVML with memory convgpu cannot attribute: the process of that " \
               "pid has no device node of the GPU open" in caplog.text
    # a process that holds the node but started after NVML listed the memory (a reused pid) is
    # not its holder either: the row was first seen at an earlier sample
    bs = backstop(Books([], {}), place=lambda pid, dev: placed.append(pid), holding={b.pid})
    bs.attribution.first[(b.pid, 0)] = 0.0         # listed since boot: before b started
    bs.attribution.clock = lambda: 0.0
    bs.step({(b.pid, 0): GiB}, 1)
    assert placed == [] and bs.books.unattributed == {0: GiB} and running(b)
    assert "started after NVML listed the memory (a reused pid)" in caplog.text


def test_a_graphics_process_is_placed_in_a_container_and_never_when_it_is_the_hosts(sleepers):
    """Issue 47 finding 5: graphics processes (in no compute list) are placed and counted as
    compute ones are, in containers; a display server of the host or a system unit is counted
    against the GPU and never stopped."""
    a, b, _ = sleepers
    box = Box(1, "t", set())
    books = Books([box], {1: 256 * MiB})

    def place(pid, dev):
        box.pids.add(pid)
        return box
    where = {a.pid: box.container, b.pid: Container("/system.slice/gdm.service", "/system.slice/gdm.service",
                                                     "systemd")}
    bs = backstop(books, place=place, holding={a.pid, b.pid}, container_of=lambda pid: where[pid])
    assert bs.step({(a.pid, 0): GiB, (b.pid, 0): 2 * GiB}, 1, compute=set())
    assert box.pids == {a.pid} and state(a) == "stopped" and running(b)
    assert books.unattributed == {0: 2 * GiB}


def test_memory_a_gone_member_left_stays_its_containers_and_stops_every_process_of_its_cgroup(sleepers, caplog):
    """Issue 47 finding 2: NVML still lists a gone member's pid (another process keeps the
    driver's files); once its exit settled, the bytes are its container's: counted, and the
    container's processes (none placed: the holder made no call) are stopped while over."""
    caplog.set_level(logging.INFO, logger="convgpu")
    a, b, c = sleepers
    books = Books([], {})
    ctr = Container("tenant-id", "/tenant")
    books.departed[4242] = Departed(ctr, "tenant", {0: 256 * MiB}, at=0.0, settled=0.0)
    bs = backstop(books, procs=lambda cg: {a.pid, b.pid} if cg == "/tenant" else set())
    bs.step({(4242, 0): 600 * MiB}, 1, now=10.0)
    assert running(a) and books.orphaned == {}     # its exit has not settled: the exit holds it
    books.departed[4242].settled = 10.0
    bs.step({(4242, 0): 600 * MiB}, 2, now=10.2)
    assert running(a) and books.orphaned == {}     # within DEPARTED_GRACE: the driver may be tearing down
    assert bs.step({(4242, 0): 600 * MiB}, 3, now=10.0 + DEPARTED_GRACE)
    assert books.orphaned == {"tenant-id": {0: 600 * MiB}} and state(a) == state(b) == "stopped" and running(c)
    assert "container tenant GPU0: over its limit by the driver's count: NVML 600.0 MiB" in caplog.text
    assert "left by its processes that exited (pids 4242)" in caplog.text
    assert bs.gone_rows(11.0)[0]["bytes"] == 600 * MiB
    bs.step({}, 4, now=11.0)                        # NVML lists it no more: freed, resumed, forgotten
    assert running(a) and running(b) and books.departed == {} and books.orphaned == {}


def test_a_reused_member_pid_holds_what_the_probes_account_for_it_and_the_gone_one_the_rest(sleepers):
    a, _, _ = sleepers
    victim = Box(2, "victim", {a.pid})
    books = Books([victim], {2: GiB})
    books.departed[a.pid] = Departed(Container("tenant-id", "/tenant"), "tenant", {0: 256 * MiB}, 0.0, 1.0)
    bs = backstop(books, accounted=lambda: {(a.pid, 0): 300 * MiB})
    bs.step({(a.pid, 0): 900 * MiB}, 1, now=5.0)
    assert running(a)                                # the victim holds 300 MiB of its 1 GiB
    assert bs.found.held == {("victim", 0): 300 * MiB, ("tenant-id", 0): 600 * MiB}


def test_memory_no_row_names_is_unattributed_above_the_gpus_floor():
    bs = backstop(Books([], {}))
    bs.step({(1, 0): 0}, 1, totals={0: 500 * MiB})           # the driver's own: the floor
    assert bs.books.unattributed == {}
    bs.step({}, 2, totals={0: 1524 * MiB})                   # one sample: a transient
    assert bs.books.unattributed == {}
    bs.step({}, 3, totals={0: 1524 * MiB})                   # two in a row: 1 GiB nobody names
    assert bs.books.unattributed == {0: GiB}
    bs.step({}, 4, totals={0: 500 * MiB})
    assert bs.books.unattributed == {}


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
