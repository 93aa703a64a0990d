"""Shared fixtures. System tests need root, bcc and the built stand-in driver; when the README's
test command runs them (CONVGPU_REQUIRE_SYSTEM=1, also in CI) a missing prerequisite FAILS
instead of skipping, so a broken set-up cannot pass as 'skipped'."""
import fcntl
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

import childwait
from convgpu.enforcer.tenants.containers import remove_cgroup  # noqa: F401  (the tests' too)
from convgpu.paths import build_dir
from convgpu.probes.ledger import footprint  # noqa: F401  (bytes an allocation takes: BPF's rule)

REQUIRE = os.environ.get("CONVGPU_REQUIRE_SYSTEM") == "1"
# Compiled BPF programs are cached in a directory of the session's (probes/bpfcache.py), never
# the host's: the first tracer compiles, every later one, in-process or a CLI subprocess that
# inherits this, replays that compile. CONVGPU_BPF_CACHE=off runs the suite compiled throughout.
BPF_CACHE = os.environ.setdefault("CONVGPU_BPF_CACHE", tempfile.mkdtemp(prefix="convgpu-bpfcache-"))
# pytest-xdist (the README's `pytest -n 3`): the workers are processes started by a controller
# that imported this first, so they inherit its BPF cache and its lock directory (host_turn).
# Uprobes are set on a file's inode: a worker's probes and enforcers would see, place and stall
# the other worker's stand-in callers. So each worker but the first runs on a copy of the build
# of its own (CONVGPU_BUILD: build_dir(), and every CLI subprocess, inherit it).
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
LOCKS = os.environ.setdefault("CONVGPU_TEST_LOCKS", tempfile.mkdtemp(prefix="convgpu-suite-"))
# One enforcer per host (enforcer/hostlock.py): the lock's path is moved for tests only. Each
# worker's enforcers run on a copy of the stand-in driver of their own (below), so they lock a
# file of the worker's; other worktrees' suites have their own LOCKS
os.environ["CONVGPU_HOST_LOCK"] = f"{LOCKS}/enforcer-{WORKER or 'main'}.lock"
# `convgpu trace` keeps each container's run in the job history of the state dir (issue 42): the
# session's own, never the host's /var/lib/convgpu (the enforcer's tests give --state-dir)
STATE = os.environ.setdefault("CONVGPU_STATE_DIR", tempfile.mkdtemp(prefix="convgpu-state-"))
if WORKER not in ("", "gw0") and build_dir().is_dir():
    _copy = tempfile.mkdtemp(prefix=f"convgpu-build-{WORKER}-")
    shutil.copytree(build_dir(), _copy, symlinks=True, dirs_exist_ok=True)
    os.environ["CONVGPU_BUILD"] = _copy
MiB = 1 << 20
GiB = 1 << 30
childwait.install()     # a test's poll()/wait() leaves the in-process holder's ptrace-stops alone


def need(condition: bool, reason: str):
    if condition:
        return
    if REQUIRE:
        pytest.fail(f"prerequisite missing (CONVGPU_REQUIRE_SYSTEM=1): {reason}")
    pytest.skip(reason)


def prom_samples(text: str) -> set:
    """The samples of a Prometheus exposition as (name, sorted labels, value): what a scraper
    reads, where `1` and `1.0`, `3221225472` and `3.221225472e+09`, or the labels' order do
    not matter (prometheus_client writes values as Go floats and sorts labels)."""
    from prometheus_client.parser import text_string_to_metric_families
    return {(s.name, tuple(sorted(s.labels.items())), s.value)
            for f in text_string_to_metric_families(text) for s in f.samples}


@pytest.fixture(scope="session")
def build() -> Path:
    b = build_dir()
    need((b / "standin" / "libcuda.so.1").exists() and (b / "cgcaller").exists(),
         f"native parts not built in {b}: run `make`")
    return b


@pytest.fixture(scope="session")
def root():
    need(os.geteuid() == 0, "needs root (uprobes, cgroups)")
    try:
        import bcc  # noqa: F401
    except ImportError:
        need(False, "bcc not importable: install python3-bpfcc, venv with --system-site-packages")


def _lines(stream) -> "queue.Queue":
    """A thread per stream turns its lines into a queue, so waiting has a real time limit
    (a blocking readline() would wait forever on a process that stays silent)."""
    q = getattr(stream, "_convgpu_lines", None)
    if q is None:
        q = stream._convgpu_lines = queue.Queue()

        def pump():
            for line in iter(stream.readline, ""):
                q.put(line)
            q.put(None)
        threading.Thread(target=pump, daemon=True).start()
    return q


def rest_of(stream, timeout: float = 30) -> list[str]:
    """Every line left until EOF, whether or not lines_until has read this stream before."""
    q = _lines(stream)
    out: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = q.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            break
        if line is None:
            q.put(None)
            break
        out.append(line.rstrip())
    return out


def lines_until(stream, match, sink: list, timeout: float = 30, what: str = "output"):
    """Read lines of `stream` into `sink` until `match(line)`; returns that line. EOF or the
    time limit raise with everything read so far (the process's own words)."""
    q = _lines(stream)
    deadline = time.monotonic() + timeout
    while True:
        try:
            line = q.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"{what}: expected line not seen in {timeout} s: {sink[-30:]}") from None
        if line is None:
            q.put(None)   # EOF stays EOF for the next caller
            raise AssertionError(f"{what} ended before the expected line: {sink[-30:]}")
        line = line.rstrip()
        sink.append(line)
        if match(line):
            return line


def stop_all(procs, *enforcers):
    """A test's finally: each process (None: not started) killed and reaped, then each
    enforcer (None: not started) closed."""
    for p in procs:
        if p:
            p.kill()
            p.wait()
    for e in enforcers:
        if e:
            e.close()


def trace_rows_until(tr, ready, timeout: float) -> list[tuple[int, int, int]]:
    """`convgpu trace --json`'s (tr) snapshots read until ready(rows) or `timeout` s; rows:
    (pid, gpu, live bytes) of every process the last one showed."""
    deadline = time.monotonic() + timeout
    while True:
        snap = json.loads(tr.stdout.readline())
        rows = [(p["pid"], p["gpu"], p["live"]) for c in snap["containers"] for p in c["processes"]]
        if ready(rows) or time.monotonic() > deadline:
            return rows


def sigint_took(p, timeout: float) -> tuple[int, float]:
    """SIGINT to p: (its exit code, the seconds it took to end)."""
    t0 = time.monotonic()
    p.send_signal(signal.SIGINT)
    rc = p.wait(timeout=timeout)
    return rc, time.monotonic() - t0


def kill_if_running(p):
    if p.poll() is None:
        p.kill()
        p.wait()


class Caller:
    """A running tests/standin/cgcaller: waits for its `ready` line, then holds until told."""

    def __init__(self, argv, env, hold=True):
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=env)
        self.pid = self.p.pid
        self.lines = []
        self.allocated = (0, 0)
        self.freed = (0, 0)
        self._read_until("ready")

    def _read_until(self, word, timeout=30):
        def match(line):
            parts = line.split()
            if parts[0] in ("allocated", "freed"):
                setattr(self, parts[0], (int(parts[1]), int(parts[2])))
            return parts[0] == word
        try:
            return lines_until(self.p.stdout, match, self.lines, timeout, "caller")
        except AssertionError as e:
            raise AssertionError(f"{e} {self.p.stderr.read() if self.p.poll() is not None else ''}") from None

    def release(self):
        """Let it free everything and exit; returns the exit code."""
        self.p.stdin.write("\n")
        self.p.stdin.flush()
        self._read_until("exit")
        return self.p.wait(timeout=30)

    def kill(self):
        self.p.kill()
        return self.p.wait(timeout=30)


@pytest.fixture
def short_tmp():
    """A fresh dir of a short path, for UNIX sockets: a socket's path holds at most 107 bytes,
    and pytest's tmp_path under xdist with a long test name is 80 already (the DRA plugin's
    sockets add 40)."""
    d = tempfile.mkdtemp(prefix="cg-", dir="/tmp")
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def sleepers():
    """Three real processes (`sleep 60`) to stop, resume and kill; killed at the end."""
    ps = [subprocess.Popen(["sleep", "60"]) for _ in range(3)]
    yield ps
    for p in ps:
        p.kill()
        p.wait()


@pytest.fixture
def private_copy(build, tmp_path):
    """A copy of the stand-in driver: a new inode nobody has probed."""
    d = tmp_path / "drv"
    d.mkdir()
    shutil.copy(build / "standin" / "libcuda.so.1", d / "libcuda.so.1")
    return d / "libcuda.so.1"


@pytest.fixture(scope="session")
def caller_env(build):
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = str(build / "standin")
    env["CONVGPU_STANDIN_SHM"] = f"/convgpu-test-{os.getpid()}"
    yield env
    subprocess.run([str(build / "standin" / "standin-usage"), "--unlink"], env=env, capture_output=True)


@pytest.fixture
def run_caller(build, caller_env):
    started = []

    def run(family, *args, hold=True, env=None):
        argv = [str(build / "cgcaller"), family, *map(str, args)] + (["--hold"] if hold else [])
        c = Caller(argv, {**caller_env, **(env or {})})
        started.append(c)
        return c

    yield run
    for c in started:
        if c.p.poll() is None:
            c.kill()


@pytest.fixture(scope="session")
def session_tracer(root, build):
    from convgpu.probes.tracer import Tracer
    t = Tracer(libraries=(str(build / "standin" / "libcuda.so.1"), str(build / "standin" / "libcudart.so.13")),
               discover=False).start()
    yield t
    t.close()


@pytest.fixture
def tracer(session_tracer):
    """The shared tracer, drained first: tests in between (enforcers, floods) run stand-in
    callers that it also sees, and a ring buffer left full would drop this test's events."""
    drain(session_tracer)
    drops = session_tracer.stats()["drops"]
    yield session_tracer
    assert session_tracer.stats()["drops"] == drops, "events dropped during the test"


EVENTS: dict[int, list] = {}


def cuda_prelude(lib) -> str:
    """Python lines that bring up a context on `lib` (a libcuda.so.1): cu, ctypes ready."""
    return (f"import ctypes,os,sys; cu=ctypes.CDLL('{lib}'); cu.cuInit(0);"
            "d=ctypes.c_int(); c=ctypes.c_void_p(); cu.cuDeviceGet(ctypes.byref(d),0);"
            "cu.cuDevicePrimaryCtxRetain(ctypes.byref(c),d); cu.cuCtxSetCurrent(c)\n")


def drain(tracer):
    """Poll the tracer, keeping every event per pid so no test loses another's events."""
    for e in tracer.poll():
        EVENTS.setdefault(e.pid, []).append(e)


def usage_of(tracer, pid):
    """{dev: ProcUsage} for one process, after draining events."""
    drain(tracer)
    return {u.dev: u for u in tracer.usage() if u.pid == pid}


def events_of(tracer, pid, wait_for=None, timeout=5.0):
    """All events of one process so far; with wait_for=op, polls until such an event came."""
    deadline = time.monotonic() + timeout
    while True:
        drain(tracer)
        got = EVENTS.get(pid, [])
        if wait_for is None or any(e.op == wait_for for e in got) or time.monotonic() > deadline:
            return list(got)
        time.sleep(0.02)


@pytest.fixture
def cgroups(root):
    """make(name) -> a fresh cgroup2 directory, removed (once empty) after the test."""
    from convgpu.enforcer.tenants.containers import cgroup_layout
    lay = cgroup_layout()
    need(lay.v2_root is not None, "no cgroup2 hierarchy")
    base = Path(lay.v2_root) / f"convgpu-test-{os.getpid()}-{time.monotonic_ns()}"

    def make(name):
        d = base / name
        d.mkdir(parents=True, exist_ok=True)
        return d

    yield make
    # every directory under base, deepest first, and what a test left running in one killed (a
    # clone3 child of a killed parent): else its rmdir was retried for 2 s, and it leaked (as
    # did a nested one's parents, kubepods/pod<uid>/<id>)
    for d in sorted((p for p in base.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)) + [base]:
        try:
            if (d / "cgroup.procs").read_text().strip():
                (d / "cgroup.kill").write_text("1")
        except OSError:
            pass
        remove_cgroup(d)


# --- the enforcer on the stand-in driver (tests/system/test_enforce*.py) ---

@pytest.fixture
def env5(caller_env):
    """Callers share one stand-in GPU of 5 GiB, like the paper's K20m experiments."""
    e = dict(caller_env, CONVGPU_STANDIN_CAPACITY=str(5 * GiB),
             CONVGPU_STANDIN_SHM=f"/convgpu-enf-{os.getpid()}-{time.monotonic_ns()}")
    yield e
    subprocess.run([e["LD_LIBRARY_PATH"] + "/standin-usage", "--unlink"], env=e, capture_output=True)


def popen_in(cg, *argv, env=None):
    """argv started inside cgroup `cg` (joins before exec: its first CUDA call is there), its
    stdin, stdout and stderr piped (text)."""
    argv = ["/bin/sh", "-c", f'echo $$ > {cg}/cgroup.procs && exec "$0" "$@"', *map(str, argv)]
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


def start_in(cg, build, env, *args):
    """cgcaller started inside cgroup `cg`."""
    return popen_in(cg, build / "cgcaller", *args, env=env)


def read_until(p, word, timeout=20):
    """The caller's stdout lines up to the one starting with `word`."""
    lines: list = []
    lines_until(p.stdout, lambda line: line.split()[0] == word, lines, timeout, "caller")
    return lines


def proc_state(pid):
    """A thread's state letter ("PID/task/TID"), or a process's: "T" while any of its threads
    is held at a call (the enforcer holds the asking thread alone under ptrace, state "t", its
    siblings run: docs/ENFORCE.md, "Waits"), else its main thread's."""
    main = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    if "/" in str(pid) or main in "Tt":
        return "T" if main == "t" and "/" not in str(pid) else main
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            if open(f"/proc/{pid}/task/{t}/stat").read().rsplit(")", 1)[1].split()[0] == "t":
                return "T"
        except OSError:
            pass
    return main


def wait_state(pid, want, timeout=20):
    """Every thread of pid in state `want`. The stop lands shortly after the BPF program asks
    for it (30-75 us, FACTS.md); under load on 2 vCPUs a sleeping sibling thread can take
    much longer to join the group stop, which is still before the allocation runs. "T" (held):
    stopped, or held alone by ptrace ("t") while its siblings sleep or run (a hold of one
    thread is not a group stop)."""
    deadline = time.monotonic() + timeout
    states = []
    while time.monotonic() < deadline:
        states = [proc_state(f"{pid}/task/{t}") for t in os.listdir(f"/proc/{pid}/task")]
        if all(s == want for s in states) or (want == "T" and "t" in states
                                              and all(s in "tTSRD" for s in states)):
            return
        time.sleep(0.01)
    raise AssertionError(f"pid {pid} not all {want}: {states}")


class StateWatch:
    """The state letters of every thread of pid, sampled every millisecond or so on a thread of
    its own from start() to stop(), which returns them: a check that a process was "never
    stopped" over a window, where one sample after a sleep sees only its end. A thread that is
    gone (or the process) ends the sampling of it, not the watch."""

    def __init__(self, pid: int):
        self.pid, self.samples, self._stop = pid, [], threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            try:
                tids = os.listdir(f"/proc/{self.pid}/task")
            except OSError:
                return
            for t in tids:
                try:
                    self.samples.append(open(f"/proc/{self.pid}/task/{t}/stat").read().rsplit(")", 1)[1].split()[0])
                except OSError:
                    pass
            time.sleep(0.001)

    def start(self) -> "StateWatch":
        self._t.start()
        return self

    def stop(self) -> list[str]:
        self._stop.set()
        self._t.join(timeout=10)
        return self.samples


# Capabilities eBPF needs (CAP_SYS_ADMIN implies the other two): a shim-only enforcer runs
# without them, so the tests prove that nothing it does needs eBPF.
NO_BPF = ("setpriv", "--bounding-set", "-bpf,-perfmon,-sys_admin", "--")
CAP_BPF_BITS = (39, 38, 21)   # CAP_BPF, CAP_PERFMON, CAP_SYS_ADMIN


def until(cond, timeout: float, what: str):
    """Polls cond() until it holds; fails with `what` after timeout seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def run_dir_for(tag: str) -> str:
    """A fresh run dir on tmpfs, as /run is on a systemd host: on this VM's ext4 /tmp a state
    file's write + rename can hold the enforcer's loop for hundreds of ms under load, and
    stalls and resumes wait for it. Removed when the session ends."""
    d = tempfile.mkdtemp(prefix=f"convgpu-{tag}-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    _RUN_DIRS.append(d)
    return d


_RUN_DIRS: list[str] = []
_STATE_OF: dict[str, str] = {}   # run dir -> its enforcers' state dir (Enforcing)


def inprocess_enforcer(lib, tag: str, limit: int, capacity: dict | None = None, **kw):
    """An Enforcer in this process over the stand-in driver `lib` (policy fifo, every limit
    `limit`, capacity {0: 4 GiB} unless given), its run dir on tmpfs; not started."""
    from convgpu.enforcer.daemon import Enforcer
    from convgpu.enforcer.tenants.limits import LimitRules
    from convgpu.probes.tracer import Tracer
    run_dir = run_dir_for(tag)
    kw.setdefault("state_dir", run_dir)     # context measurements: this test's own
    kw.setdefault("ctx_overhead", 0)        # the stand-in's contexts cost 0 (STANDIN_CTX_OVERHEAD unset)
    return Enforcer(Tracer(libraries=(str(lib),), discover=False), "fifo", capacity or {0: 4 * GiB},
                    LimitRules({}, limit), run_dir=run_dir, **kw)


class StandinNvml:
    """process_memory() as NVML answers it, from the stand-in driver's shared segment (its
    per-process slots count allocations and each context's CONVGPU_STANDIN_CTX_OVERHEAD): slot
    i at 352 + 144 i holds (i32 pid, u32, u64 start time, u64 used[16])
    (tests/standin/standin_shm.h). name/driver: what gpus() and .driver tell (none: no GPU
    facts, as when NVML lists no device)."""

    ok = True

    def __init__(self, shm: str, name: str = "", driver: str = "", devices: int = 1):
        self.path = f"/dev/shm/{shm.lstrip('/')}"
        self.seg = None
        self.name, self.driver, self.devices = name, driver, devices
        self._segment()

    def _segment(self):
        """Mapped once the first stand-in process has made the segment."""
        if self.seg is None and os.path.exists(self.path):
            import mmap
            fd = os.open(self.path, os.O_RDONLY)
            self.seg = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
            os.close(fd)
        return self.seg

    def process_memory(self) -> dict[tuple[int, int], int]:
        import struct
        if self._segment() is None:
            return {}
        nslots, hiwater = struct.unpack_from("<I4xI", self.seg, 12)
        out = {}
        for i in range(min(nslots, hiwater)):
            pid, = struct.unpack_from("<i", self.seg, 352 + 144 * i)
            used = struct.unpack_from("<16Q", self.seg, 352 + 144 * i + 16)
            for dev, n in enumerate(used):
                if pid > 0 and n:   # a process with two stand-in copies has two slots: summed, as
                    out[(pid, dev)] = out.get((pid, dev), 0) + n    # probes.nvml sums its rows
        return out

    def gpus(self) -> list:
        if not self.name:
            return []       # totals come from --gpu-memory here
        from convgpu.probes.nvml import GpuInfo
        return [GpuInfo(d, self.name, 80 * GiB, 0, f"GPU-5ca1ab1e-0000-4000-8000-0000000000{d:02x}")   # the stand-in's
                for d in range(self.devices)]


def pytest_sessionfinish(session, exitstatus):
    for d in _RUN_DIRS:     # tmpfs is memory: leave nothing behind
        shutil.rmtree(d, ignore_errors=True)
    if WORKER:              # the worker's own build copy; the cache and locks are the controller's
        if os.path.basename(os.environ.get("CONVGPU_BUILD", "")).startswith(f"convgpu-build-{WORKER}-"):
            shutil.rmtree(os.environ["CONVGPU_BUILD"], ignore_errors=True)
        return
    for d in (BPF_CACHE, LOCKS, STATE):
        if os.path.basename(d).startswith(("convgpu-bpfcache-", "convgpu-suite-", "convgpu-state-")):
            shutil.rmtree(d, ignore_errors=True)


@contextmanager
def host_turn(exclusive: bool):
    """A readers-writer lock of the host between xdist workers (flock(2) on LOCKS' files): a test
    marked `exclusive` runs while no other test runs, every other test beside any but those. The
    gate keeps a waiting exclusive test from being starved by the other worker's next tests."""
    gate = os.open(f"{LOCKS}/gate", os.O_RDWR | os.O_CREAT, 0o600)
    host = os.open(f"{LOCKS}/host", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(gate, fcntl.LOCK_EX)
        fcntl.flock(host, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        if not exclusive:
            fcntl.flock(gate, fcntl.LOCK_UN)
        yield
    finally:
        os.close(host)      # closing releases both
        os.close(gate)


# Under xdist the modules go to the workers in the order collected here (pytest_configure turns
# xdist's own order, most tests first, off): every `exclusive` module first, so they run back
# to back while the workers start, instead of each one waiting for the other worker's module in
# hand to end (a minute when that was the torture); then the longest modules (measured in
# fresh-clone runs, 2026-11-27: seconds a module takes), so that none of them starts last and
# leaves the other worker idle; then the rest, most tests first, as xdist does.
LONGEST = ("test_torture.py", "test_bench_sched.py", "test_bpfcache.py", "test_waits.py",
           "test_bench_e2e_toggle.py", "test_nvml_faults.py", "test_trace_exit.py", "test_sampler_live.py",
           "test_enforce_control.py", "test_durable_decisions.py", "test_enforce.py")


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(session, config, items):
    if not WORKER:
        return
    modules: dict[str, list] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)

    def rank(path):
        its = modules[path]
        name = path.rsplit("/", 1)[-1]
        if any(i.get_closest_marker("exclusive") for i in its):
            return (0, 0)
        if name in LONGEST:
            return (1, LONGEST.index(name))
        return (2, -len(its))
    items[:] = [i for path in sorted(modules, key=rank) for i in modules[path]]


@pytest.fixture(scope="module", autouse=True)
def _host_turn(request):
    """Under xdist, each module takes its turn of the host (host_turn) while its tests run on a
    worker, module-scoped fixtures included (a shim witness holding the stand-in open was
    probed by the other worker's discovery): a module with a test marked `exclusive` (its
    probes reach every driver file on the host: discovery stops and probes any process that
    opens one, the other worker's too) runs while no other module runs."""
    if not WORKER:
        yield
        return
    exclusive = any(i.get_closest_marker("exclusive") for i in request.session.items if i.module is request.module)
    with host_turn(exclusive):
        yield


class Enforcing:
    """`convgpu enforce` as a subprocess on the stand-in driver, with a run dir of its own;
    no_bpf: with --no-probes and without the capabilities eBPF needs. --ctx-overhead 0 unless
    given: the stand-in's contexts cost 0 unless CONVGPU_STANDIN_CTX_OVERHEAD says otherwise, and
    with no NVML here the enforcer would charge each its conservative 1 GiB (enforcer/ctxest.py)."""

    def __init__(self, build, *args, run_dir=None, no_bpf=False, env=None, start_timeout=30, state_dir=None):
        self.run_dir = run_dir or run_dir_for("run")
        if "--ctx-overhead" not in args:
            args = (*args, "--ctx-overhead", "0")
        # the state dir (run-time decisions, learned context sizes): the test's own, never the
        # host's /var/lib/convgpu, and the same for every restart on this run dir
        if state_dir is None and self.run_dir not in _STATE_OF:
            _STATE_OF[self.run_dir] = run_dir_for("state")
        self.state_dir = state_dir or _STATE_OF[self.run_dir]
        if "--state-dir" not in args:
            args = (*args, "--state-dir", self.state_dir)
        self.handover = "--handover" in args
        self.p = subprocess.Popen([*(NO_BPF if no_bpf else ()), sys.executable, "-m", "convgpu.cli.main", "enforce",
                                   "--no-discover", "--lib", str(build / "standin" / "libcuda.so.1"),
                                   "--run-dir", self.run_dir, *args, *(["--no-probes"] if no_bpf else [])],
                                  stderr=subprocess.PIPE, text=True, env=env)
        self.log = []
        try:
            self.wait_for("enforcing:", start_timeout)
        except BaseException:   # it may still start (its uprobe attaches wait on other jobs here):
            self.p.terminate()  # then it would enforce on the stand-in under the next tests
            try:
                self.p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
            raise

    def capabilities(self) -> int:
        line = next(x for x in open(f"/proc/{self.p.pid}/status") if x.startswith("CapEff:"))
        return int(line.split()[1], 16)

    def ctl(self, **msg):
        from convgpu.enforcer.serving.server import request
        return request(f"{self.run_dir}/control.sock", msg)

    def cli(self, *args, check=True):
        """A client command (status, limit set, reload, run) against this enforcer."""
        r = subprocess.run([sys.executable, "-m", "convgpu.cli.main", *args, "--run-dir", self.run_dir],
                           capture_output=True, text=True, timeout=60)
        if check:
            assert r.returncode == 0, r.stderr
        return r

    def wait_for(self, text, timeout=30):
        return lines_until(self.p.stderr, lambda line: text in line, self.log, timeout,
                           f"enforcer log (waiting for {text!r})")

    def close(self):
        """For finally blocks: stop it unless a test already did."""
        if self.p.poll() is None:
            self.stop()

    def stop(self):
        """A teardown, not a restart: with --handover, SIGINT (released at once). Its SIGTERM would
        leave what it held held and admission on for the handover's seconds, with no enforcer:
        the next test's processes on the same stand-in stopped at their first call."""
        self.p.send_signal(signal.SIGINT if self.handover else signal.SIGTERM)
        rc = self.p.wait(timeout=30)
        self.log += rest_of(self.p.stderr)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        return rc


def shim_env(env, enf=None, **more):
    """env for a process under the preload shim, talking to `enf` (or to no enforcer)."""
    from convgpu.cli import shim
    return dict(env, **shim.shim_env(enf.run_dir if enf else "/nonexistent"), CONVGPU_SHIM_LOG="2", **more)


# How a container is limited (issue "shim": the scenarios run in every mode): stopped by the
# probes; waiting in the shim with no probes and no CAP_BPF; the shim with the probes also on.
MODES = ("probes", "shim-only", "shim+probes")
WAITING = {"probes": "T", "shim-only": "S", "shim+probes": "S"}   # a waiter's process state


def enforcing_in(mode, build, *args):
    enf = Enforcing(build, *args, no_bpf=mode == "shim-only")
    if mode == "shim-only":
        assert not any(enf.capabilities() >> bit & 1 for bit in CAP_BPF_BITS)
    return enf


def limited_env(mode, env, enf):
    return env if mode == "probes" else shim_env(env, enf)


@contextmanager
def serving(enf, on_events=lambda events: None, seconds: float = 120):
    """An in-process enforcer (real probes, real cgroups) started and its loop run in a thread
    for the with-block; on_events sees each step's events. Stopped and closed after. The test's
    enf.status() reads the books from the test's thread while the loop changes them (the daemon
    serves its own status inside the loop): read again where a dict changed size under it."""
    enf.start()
    done = threading.Event()
    inside = enf.status

    def status():
        for _ in range(50):
            try:
                return inside()
            except RuntimeError:   # "dictionary changed size during iteration"
                time.sleep(0.01)
        return inside()
    enf.status = status

    def step(events):
        on_events(events)
        if done.is_set():
            sys.exit()

    def serve():
        try:
            enf.run(seconds, on_step=step)
        except SystemExit:
            pass
    loop = threading.Thread(target=serve, daemon=True)
    loop.start()
    try:
        yield enf
    finally:
        done.set()
        loop.join(timeout=10)
        enf.close()


# --- other users of the stand-in driver (a `convgpu trace` demo, another session's tests) ---

def _ancestors(pid: int) -> set[int]:
    seen = set()
    while pid > 1 and pid not in seen:
        seen.add(pid)
        try:
            with open(f"/proc/{pid}/status") as f:
                pid = int(next(line for line in f if line.startswith("PPid:")).split()[1])
        except (OSError, StopIteration, ValueError):
            break
    return seen


def standin_users(lib: Path | None = None) -> list[str]:
    """'PID COMM (CGROUP)' of every process that maps this build's stand-in libcuda and is not
    this session's (nor a descendant of it): probes on that file see their calls too, and an
    enforcer over it places them, so a test's numbers can be off because of them."""
    lib = lib or build_dir() / "standin" / "libcuda.so.1"
    try:
        ino = os.stat(lib).st_ino
    except OSError:
        return []
    me, out = os.getpid(), []
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{d}/maps") as f:
                if not any(line.split()[4:5] == [str(ino)] and line.rstrip().endswith("/libcuda.so.1") for line in f):
                    continue
            if me in _ancestors(int(d)):
                continue
            with open(f"/proc/{d}/comm") as f:
                comm = f.read().strip()
            with open(f"/proc/{d}/cgroup") as f:
                cg = f.read().splitlines()[-1].split(":", 2)[2]
        except (OSError, IndexError):
            continue
        out.append(f"{d} {comm} ({cg})")
    return out


def pytest_report_header(config):
    users = standin_users()
    if users:
        return [f"NOTE: {len(users)} other process(es) use this build's stand-in driver, and probes "
                f"and enforcers in these tests see them too: {'; '.join(users)}"]
    return []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed system test says which other processes used the stand-in driver meanwhile."""
    outcome = yield
    rep = outcome.get_result()
    if rep.when == "call" and rep.failed and item.get_closest_marker("system") is not None:
        users = standin_users()
        if users:
            rep.sections.append(("other users of the stand-in driver", "\n".join(
                ["these processes, not started by this session, also called the stand-in driver "
                 "(a `convgpu trace` demo, another session's tests):", *users])))
