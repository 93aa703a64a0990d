"""The pieces bench/torture.py drives: the run's set-up and result, the enforcer it kills and
restarts (Daemon), a container's job (Job: a cgroup of `turns` processes registered with `convgpu
run`), and what the checks read from the host (the driver's per-process counts, stopped threads,
their tracers, foreign enforcers)."""
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

MiB = 1 << 20
POINTS = ("place", "grant", "resume", "save", "held", "ack")   # core/faults.py's kill points


@dataclass
class Setup:
    lib: str                       # the libcuda.so.1 the enforcer probes
    turns: str                     # build/turns: threads that allocate, hold and free, in rounds
                                   # (every other process of a container with VMM handles: -v)
    env: dict                      # the workload's environment (which driver, the stand-in's settings)
    counts: object                 # () -> {(pid, gpu): bytes}: the driver's own per-process counts
    containers: int = 3            # at once; as one finishes, a new one starts (while kills remain)
    procs: int = 2                 # processes per container
    threads: int = 3               # threads per process, each holding one allocation at a time
    size: int = 128 * MiB
    hold_ms: int = 100
    rounds: int = 30
    limit: int = 768 * MiB         # each container's, given at run time
    default_limit: int = 512 * MiB
    gpu_memory: int = 1792 * MiB   # less than the containers' limits together: they contend
    ctx: int | None = 64 * MiB     # --ctx-overhead: what the stand-in charges a context (None: not given)
    tolerance: int = 0             # bytes status may differ from the driver per container
    over_tolerance: int = 0        # bytes the driver may show above a limit (a real card's page rounding)
    kills: int = 50
    seed: int = 1
    faults: tuple = POINTS
    fault_share: float = 0.35      # of the kills: at a fault point
    start_share: float = 0.1       # ... during the start, before admission
    early_share: float = 0.25      # ... within 0.4 s of admission (no checks that round)
    deadline_s: float = 900.0
    extra: tuple = ()              # more `convgpu enforce` options
    log: object = None             # a callable(str) for progress lines


@dataclass
class Result:
    kills: dict = field(default_factory=dict)        # kind -> how many
    restart_s: list = field(default_factory=list)    # Popen to "enforcing:" (admitting)
    unchecked_s: list = field(default_factory=list)  # the kill to admitting again: no enforcer admitted
    jobs_started: int = 0
    jobs_done: int = 0
    jobs_lost: list = field(default_factory=list)    # (name, why)
    refused: int = 0                                 # registrations refused as the enforcer died: retried
    wrong_limits: list = field(default_factory=list)
    settled_samples: int = 0
    over_limit: list = field(default_factory=list)
    stopped_unknown: list = field(default_factory=list)
    counts_checked: int = 0
    counts_mismatch: list = field(default_factory=list)
    fresh: int = 0                                   # restarts that took over nothing (pins gone)
    foreign: list = field(default_factory=list)      # other sessions' enforcers seen meanwhile
    write_ms: list = field(default_factory=list)     # an enforcer's mean time per decisions write
    exit_s: list = field(default_factory=list)       # (SIGKILL to reaped, the kill's kind)
    left_stopped: list = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> dict:
        def pct(xs, q):
            xs = sorted(xs)
            return round(xs[min(len(xs) - 1, int(q * len(xs)))], 3) if xs else None
        return {"kills": sum(self.kills.values()), "kills_by_kind": dict(sorted(self.kills.items())),
                "jobs_started": self.jobs_started, "jobs_done": self.jobs_done, "jobs_lost": len(self.jobs_lost),
                "registrations_refused_and_retried": self.refused, "wrong_limits": len(self.wrong_limits),
                "settled_samples": self.settled_samples, "over_limit_samples": len(self.over_limit),
                "stopped_unknown": len(self.stopped_unknown), "counts_checked": self.counts_checked,
                "counts_mismatch": len(self.counts_mismatch), "fresh_starts": self.fresh, "foreign_enforcers_seen": len(self.foreign),
                "decisions_write_ms": {"p50": pct(self.write_ms, 0.5),
                                       "max": round(max(self.write_ms), 3) if self.write_ms else None},
                "left_stopped": len(self.left_stopped),
                "restart_to_admission_s": {"n": len(self.restart_s), "p50": pct(self.restart_s, 0.5),
                                           "p99": pct(self.restart_s, 0.99),
                                           "max": round(max(self.restart_s), 3) if self.restart_s else None},
                "kill_to_admission_s": {"p50": pct(self.unchecked_s, 0.5), "p99": pct(self.unchecked_s, 0.99),
                                        "max": round(max(self.unchecked_s), 3) if self.unchecked_s else None},
                "kill_to_reaped_s": {"p50": pct([x for x, _ in self.exit_s], 0.5),
                                     "max": max(self.exit_s, default=None)},
                "seconds": round(self.seconds, 1)}

    def failures(self) -> list[str]:
        out = [f"other enforcers probed this host meanwhile (their discovery stops and traces our processes "
               f"too: a failure may be theirs): {self.foreign[:3]}"] if self.foreign and any(
            getattr(self, n) for n in ("jobs_lost", "wrong_limits", "over_limit", "stopped_unknown",
                                       "counts_mismatch", "left_stopped")) else []
        for name in ("jobs_lost", "wrong_limits", "over_limit", "stopped_unknown", "counts_mismatch", "left_stopped"):
            items = getattr(self, name)
            if items:
                out.append(f"{name}: {len(items)}: {items[:5]}")
        return out


class Lines:
    """A stream's lines, read by a thread (with when each came)."""

    def __init__(self, stream, on_line=None):
        self.lines: list[str] = []
        self.on_line = on_line
        self.done = threading.Event()
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream):
        for line in iter(stream.readline, ""):
            self.lines.append(line.rstrip())
            if self.on_line:
                self.on_line(line)
        self.done.set()


def python_argv() -> list[str]:
    return [sys.executable, "-m", "convgpu.cli.main"]


class Daemon:
    """One `convgpu enforce`, its log read by a thread; CONVGPU_FAULT as given."""

    def __init__(self, s: Setup, run_dir: str, state_dir: str, fault: str | None):
        env = {k: v for k, v in os.environ.items() if k != "CONVGPU_FAULT"}
        if fault:
            env["CONVGPU_FAULT"] = fault
        self.run_dir, self.fault = run_dir, fault
        self.ready = threading.Event()
        self.ready_at = None
        self.fault_at = None
        self.t0 = time.monotonic()
        self.p = subprocess.Popen([*python_argv(), "enforce", "--no-discover", "--lib", s.lib, "--run-dir", run_dir,
                                   "--state-dir", state_dir, "--gpu-memory", f"{s.gpu_memory}B", "--default-limit",
                                   f"{s.default_limit}B", *(["--ctx-overhead", f"{s.ctx}B"] if s.ctx is not None else []),
                                   *s.extra],
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  text=True, env=env)
        self.log = Lines(self.p.stderr, self._line)

    def _line(self, line: str):
        if "convgpu fault point" in line:
            self.fault_at = time.monotonic()
        if "enforcing:" in line and not self.ready.is_set():
            self.ready_at = time.monotonic()
            self.ready.set()

    def wait_ready(self, timeout: float = 60) -> bool:
        """True once admitting; False if it died first (a fault point in its start)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.ready.wait(0.02):
                return True
            if self.p.poll() is not None:
                return self.ready.is_set()
        raise RuntimeError(f"enforcer not admitting after {timeout} s: {self.log.lines[-20:]}")

    def alive(self) -> bool:
        return self.p.poll() is None

    def kill(self):
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait()

    def faulted(self) -> bool:
        return any("convgpu fault point" in x for x in self.log.lines)

    def ctl(self, msg: dict, timeout: float = 10) -> dict:
        from convgpu.enforcer.serving.server import request
        return request(os.path.join(self.run_dir, "control.sock"), msg, timeout=timeout)


def v2_root() -> str:
    from convgpu.enforcer.tenants.containers import cgroup_layout
    return cgroup_layout().v2_root


class Job:
    """A container of `procs` processes of `turns`: by `convgpu run --limit --name` ("run"), or
    in a cgroup of the harness's given its limit by `convgpu limit set` once placed ("set")."""

    def __init__(self, s: Setup, kind: str, name: str, run_dir: str, base: str):
        self.kind, self.name, self.limit = kind, name, s.limit
        turns = f"{s.turns} -t {s.threads} -r {s.rounds} -s {s.size} -h {s.hold_ms}"
        # every other process takes VMM handles (cuMemCreate/cuMemRelease), the others pointers:
        # the stand-in gives a released handle's value out again, so its releases race creates
        script = "echo started; " + " ".join(f"{turns}{' -v' if i % 2 else ''} & p{i}=$!;" for i in range(s.procs)) + \
            " rc=0; " + \
            " ".join(f"wait $p{i} || rc=$?;" for i in range(s.procs)) + " exit $rc"
        if kind == "run":
            self.p = subprocess.Popen([*python_argv(), "run", "--limit", f"{s.limit}B", "--name", name, "--run-dir", run_dir,
                                       "--", "/bin/sh", "-c", script], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env=s.env, start_new_session=True)
            from convgpu.cli.run import PARENT
            self.cgroup = f"{PARENT}/{name}-{self.p.pid}"
            self.set_state = "given"            # registered before its first call (or refused: it ends)
        else:
            self.cgroup = f"{base}/{name}"
            os.makedirs(v2_root() + self.cgroup)
            self.p = subprocess.Popen(["/bin/sh", "-c", f'echo $$ > {v2_root() + self.cgroup}/cgroup.procs && '
                                       'exec /bin/sh -c "$0"', script], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env=s.env, start_new_session=True)
            self.set_state = "pending"          # pending | unknown (sent, no answer) | given
        self.out = Lines(self.p.stdout)
        self.err = Lines(self.p.stderr)
        self.started_at = time.monotonic()

    @property
    def started(self) -> bool:
        return "started" in self.out.lines

    def expected(self, s: Setup) -> tuple[str, int, str] | None:
        """(name, limit, source) the enforcer must show; None: either may (a set in doubt)."""
        if self.kind == "run":
            return (self.name, self.limit, "convgpu run --limit")
        if self.set_state == "given":
            return (self.name, self.limit, "convgpu limit set")
        if self.set_state == "pending":
            return (self.name, s.default_limit, "default")
        return None

    def in_force(self, s: Setup) -> int:
        """The limit its usage is held to: a set in doubt may be either (the larger bounds)."""
        return self.limit if self.kind == "run" or self.set_state != "pending" else s.default_limit

    def pids(self) -> list[int]:
        try:
            with open(v2_root() + self.cgroup + "/cgroup.procs") as f:
                return [int(x) for x in f.read().split()]
        except OSError:
            return []

    def freeze(self, on: bool):
        try:
            with open(v2_root() + self.cgroup + "/cgroup.freeze", "w") as f:
                f.write("1" if on else "0")
        except OSError:
            pass

    def frozen(self) -> bool:
        try:
            with open(v2_root() + self.cgroup + "/cgroup.events") as f:
                return "frozen 1" in f.read()
        except OSError:
            return True   # gone: nothing runs

    def remove(self):
        from convgpu.enforcer.tenants.containers import remove_cgroup
        if self.kind == "set":
            remove_cgroup(v2_root() + self.cgroup)


def standin_counts(usage_bin: str, env: dict):
    """The stand-in driver's per-process counts (its shared segment, dead processes reaped)."""
    def counts() -> dict[tuple[int, int], int]:
        r = subprocess.run([usage_bin, "--json"], env=env, capture_output=True, text=True, timeout=30)
        doc = json.loads(r.stdout)
        return {(p["pid"], d): n for p in doc.get("procs", []) for d, n in enumerate(p["used"]) if n}
    return counts


def stopped_tids(pid: int) -> set[int]:
    """pid's threads in a stop (T: job control, t: ptrace)."""
    out = set()
    try:
        for t in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{t}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in "Tt":
                    out.add(int(t))
    except OSError:
        pass
    return out


def stopped(pid: int) -> bool:
    return bool(stopped_tids(pid))


def tracer_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return int(next(x for x in f if x.startswith("TracerPid:")).split()[1])
    except (OSError, StopIteration, ValueError):
        return 0


def foreign_enforcers(ours: set[int]) -> list[str]:
    """Other `convgpu enforce` or `trace` processes with discovery on (another test session's):
    they probe every driver copy on the host, ours too, and may stop or trace our processes."""
    out = []
    for d in filter(str.isdigit, os.listdir("/proc")):
        if int(d) in ours:
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "convgpu.cli.main" not in argv or not {"enforce", "trace"} & set(argv):
            continue
        flags = [a for a in argv if a in ("--discover", "--no-discover")]
        if "enforce" in argv and flags and flags[-1] == "--no-discover":
            continue
        out.append(f"{d} {' '.join(argv)[:160]}")
    return out


def describe(pid: int) -> str:
    """'comm: tid state ...' of a process, for a failure's words."""
    try:
        comm = open(f"/proc/{pid}/comm").read().strip()
        states = [f"{t}:{open(f'/proc/{pid}/task/{t}/stat').read().rsplit(')', 1)[1].split()[0]}"
                  for t in sorted(os.listdir(f"/proc/{pid}/task"), key=int)]
        return f"{comm}: {' '.join(states)}"
    except OSError:
        return "gone"
