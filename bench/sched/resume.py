"""Issue 3's benchmark: how fast a waiter runs again once memory comes back, and what the
enforcer's loop costs in CPU under allocation load.

    .venv/bin/python -m bench.sched.resume [--trials 200] [--seconds 10] [--lib LIBCUDA]

resume latency, two cases (each trial: a waiter is stopped by BPF before its allocation ran,
then memory is returned). Times are CLOCK_MONOTONIC, taken in the processes themselves; the
waiter's is after its allocation returned, less that allocation's own duration on this driver
(the same call again, unstalled: "alloc_ms"), so that a slow real allocation is not counted:
  exit  container A (limit 3C/4 of the capacity C, 1 GiB) holds C/2; container B (new: C/4
        assigned, room for its context, which a real driver's NVML shows as ~519 MiB) asks C/2
        and stops; A's only process exits -> once its files are closed (the driver frees its
        memory then), A's assignment goes back to the pool -> B is granted and resumed; on the
        exit event already where the card has room for A's memory and B's grant together (a
        real GPU larger than the capacity: "during_teardown" counts those trials).
        resume_ms: from just before A's exit. after_gone_ms: from when A's pidfd became readable
        here (the kernel closed its files; this process's own wake-up after that is not
        counted, so it errs low by that). teardown_ms: the kernel's and driver's share between.
  free  one container (limit C), two processes: P1 holds 3C/4, P2 asks C/2 and stops; P1 frees
        -> P2's demand fits the container's assignment -> resumed. resume_ms: from just before
        P1's free; after_return_ms: from its return (negative when the waiter ran first: BPF
        settles a free at its entry).
The enforcer runs with --debug, whose lines stamp the exit path in the same clock; each trial
splits the time with them: exit event_ms (A's exit -> the enforcer handles BPF's exit event),
sigcont_ms (A's exit -> SIGCONT sent: all of convgpu's part, the kernel's exit event included),
room_ms (the kernel's exit tracepoint, where the exit makes room, as BPF stamps its event ->
SIGCONT sent),
enforcer_ms (the enforcer's cue -> SIGCONT sent; the cue is A gone, as its pidfd says, or the
exit event where B resumed during the teardown), waiter_ms (SIGCONT -> the
waiter's allocation returned, less alloc_ms); free enforcer_ms (the free's start -> SIGCONT).
enforcer CPU: utime + stime of the enforcer's pid (/proc/PID/stat) while one process in a
container allocates and frees 4 KiB at 0, 1 k and 10 k allocations a second (paced every
10 ms), as % of one core.

Processes are bench/sched/worker.py (plain ctypes): on the stand-in by default, or on the real
driver with --lib (the GPU machine). Needs root and bcc; use a private CONVGPU_BUILD when
others share the machine."""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import select
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rich.progress import Progress

from convgpu.paths import build_dir
from convgpu.units import parse_size

from .real import cgroup_dirs, enforcer, in_cgroup, proc_state, stand_in_env, unlink_stand_in

WORKER = Path(__file__).with_name("worker.py")
TICK = os.sysconf("SC_CLK_TCK")


class Worker:
    """A worker.py process inside a cgroup, read line by line with a time limit (a stopped
    process must never hang the benchmark)."""

    def __init__(self, cg: Path, lib: Path, env: dict):
        self.p = subprocess.Popen(in_cgroup(cg, sys.executable, "-S", str(WORKER), str(lib)),
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, bufsize=0)
        self.buf = b""
        self.expect("up")

    def send(self, line: str):
        self.p.stdin.write(line.encode() + b"\n")

    def line(self, timeout: float = 20.0) -> str:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.p.stdout], [], [], left)[0]:
                raise TimeoutError(f"worker {self.p.pid} ({proc_state(self.p.pid)}): no line in {timeout} s")
            chunk = os.read(self.p.stdout.fileno(), 4096)
            if not chunk:
                raise EOFError(f"worker {self.p.pid} ended (rc {self.p.wait()})")
            self.buf += chunk
        out, self.buf = self.buf.split(b"\n", 1)
        return out.decode()

    def expect(self, word: str) -> str:
        got = self.line()
        if not got.startswith(word):
            raise RuntimeError(f"worker {self.p.pid}: expected {word!r}, got {got!r}")
        return got

    def stamp(self) -> int:
        return int(self.expect("t ").split()[1])

    def wait_stopped(self, timeout: float = 10.0):
        deadline = time.monotonic() + timeout
        while proc_state(self.p.pid) not in ("T", "t"):   # t: its thread held alone (ptrace; issue 23)
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker {self.p.pid} not stopped: {proc_state(self.p.pid)}")
            time.sleep(0.001)

    def kill(self):
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait()


def wait_for(log, text: str, count: int, timeout: float = 10.0):
    """Until the enforcer has logged `text` `count` times (it has seen an exit, say)."""
    deadline = time.monotonic() + timeout
    while sum(text in line for _, line in log.lines) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"enforcer never logged {text!r} x{count}")
        time.sleep(0.002)


def settle(log, name: str, pid: int, count: int, seconds: float):
    """seconds > 0: wait until the enforcer has logged this waiter's stall `count` times, then
    `seconds` more, so that it has recorded the waiter (and told BPF that someone waits: only
    then does a free or an exit wake it at once) before memory comes back."""
    if seconds > 0:
        wait_for(log, f"stall {name} pid {pid}", count)
        time.sleep(seconds)


def stamp_of(log, pattern: str, stamp: str = r".*\(t=(\d+)\)") -> int:
    """t= of the enforcer's last debug line matching pattern (bench.sched.real logs with --debug)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        for _, line in reversed(log.lines):
            if m := re.search(pattern + stamp, line):
                return int(m.group(1))
        time.sleep(0.002)
    raise TimeoutError(f"the enforcer never logged {pattern!r}")


def exit_case(cgs, lib, env, log, cap: int, trials: int, wait: float, progress, task) -> list[dict]:
    out = []
    for i in range(trials):
        ws, fd = [], -1
        try:
            a = Worker(cgs["rexa"], lib, env)
            ws.append(a)
            fd = os.pidfd_open(a.p.pid)
            a.send(f"a {cap // 2}")
            a.stamp()
            b = Worker(cgs["rexb"], lib, env)
            ws.append(b)
            b.send(f"a {cap // 2}")
            b.wait_stopped()
            settle(log, "rexb", b.p.pid, 1, wait)
            a.send("x")
            t0 = a.stamp()
            if not select.select([fd], [], [], 20)[0]:
                raise TimeoutError(f"worker {a.p.pid} did not end")
            gone = time.monotonic_ns()
            t1 = b.stamp()
            b.send("r")
            d = int(b.expect("d ").split()[1])
            seen = stamp_of(log, f"pid {a.p.pid} exiting")
            kernel = stamp_of(log, f"pid {a.p.pid} exiting", r".*\(kernel t=(\d+)\)")
            reaped = stamp_of(log, f"pid {a.p.pid} gone")
            resumed = stamp_of(log, rf"resumed rexb pids \[{b.p.pid}\]")
            # the enforcer acts on the exit event where the card has room for the exiting
            # process's memory and the grant together, else once its pidfd fires
            early = resumed < reaped
            out.append({"resume_ms": (t1 - d - t0) / 1e6, "after_gone_ms": (t1 - d - gone) / 1e6,
                        "teardown_ms": (gone - t0) / 1e6, "alloc_ms": d / 1e6,
                        "event_ms": (seen - t0) / 1e6, "sigcont_ms": (resumed - t0) / 1e6,
                        "room_ms": (resumed - kernel) / 1e6,
                        "enforcer_ms": (resumed - (seen if early else reaped)) / 1e6,
                        "waiter_ms": (t1 - d - resumed) / 1e6, "during_teardown": early})
            b.send("x")
            b.stamp()
        finally:
            for w in ws:
                w.kill()
            if fd >= 0:
                os.close(fd)
        wait_for(log, "container rexb exited", i + 1)   # both gone: a clean slate
        wait_for(log, "container rexa exited", i + 1)
        progress.advance(task)
    return out


def free_case(cgs, lib, env, log, cap: int, trials: int, wait: float, progress, task) -> list[dict]:
    out = []
    p1 = p2 = None
    try:
        p1 = Worker(cgs["rfree"], lib, env)
        p2 = Worker(cgs["rfree"], lib, env)
        for i in range(trials):
            p1.send(f"a {cap * 3 // 4}")
            p1.stamp()
            p2.send(f"a {cap // 2}")
            p2.wait_stopped()
            settle(log, "rfree", p2.p.pid, i + 1, wait)
            p1.send("f")
            t0 = p1.stamp()
            returned = int(p1.expect("ok").split()[1])
            t1 = p2.stamp()
            p2.send("r")
            d = int(p2.expect("d ").split()[1])
            resumed = stamp_of(log, rf"resumed rfree pids \[{p2.p.pid}\]")
            out.append({"resume_ms": (t1 - d - t0) / 1e6, "after_return_ms": (t1 - d - returned) / 1e6,
                        "alloc_ms": d / 1e6, "enforcer_ms": (resumed - t0) / 1e6,
                        "waiter_ms": (t1 - d - resumed) / 1e6})
            p2.send("f")
            p2.stamp()
            p2.expect("ok")
            progress.advance(task)
    finally:
        for w in (p1, p2):
            if w:
                w.kill()
    return out


def cpu_ticks(pid: int) -> int:
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return int(f[11]) + int(f[12])   # utime, stime (fields 14 and 15)


def cpu_case(cgs, lib, env, enf_pid: int, rates, seconds: float, progress, task) -> list[dict]:
    rows = []
    w = Worker(cgs["rload"], lib, env)
    try:
        for rate in rates:
            c0, t0 = cpu_ticks(enf_pid), time.monotonic()
            if rate:
                w.send(f"l {rate} {seconds} 4096")
                _, n, took = w.line(timeout=seconds + 60).split()
            else:
                time.sleep(seconds)
                n, took = 0, seconds
            c1, t1 = cpu_ticks(enf_pid), time.monotonic()
            rows.append({"target_rate": rate, "allocs": int(n), "rate": int(n) / float(took),
                         "cpu_s": (c1 - c0) / TICK, "wall_s": t1 - t0,
                         "cpu_pct": 100 * (c1 - c0) / TICK / (t1 - t0)})
            progress.advance(task)
    finally:
        w.kill()
    return rows


def summary(rows: list[dict]) -> dict:
    """Per measure: n, p50, p99, max, mean (ms); and how many trials resumed during teardown."""
    out = {}
    for key in [k for k in rows[0] if k.endswith("_ms")]:
        s = sorted(r[key] for r in rows)
        q = statistics.quantiles(s, n=100, method="inclusive") if len(s) > 1 else s * 99
        out[key] = {"n": len(s), "p50": statistics.median(s), "p99": q[98], "max": s[-1],
                    "mean": statistics.fmean(s)}
    if "during_teardown" in rows[0]:
        out["during_teardown"] = sum(r["during_teardown"] for r in rows)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=10.0, help="per allocation rate")
    ap.add_argument("--rates", default="0,1000,10000")
    ap.add_argument("--lib", default=None, help="libcuda.so.1 (default: the build's stand-in)")
    ap.add_argument("--capacity", default="1GiB", help="--gpu-memory and every limit; on a real GPU "
                    "leave room for the contexts NVML measures (about 519 MiB each on the H100): 4GiB")
    ap.add_argument("--policy", default="fifo")
    ap.add_argument("--settle", default="0,0.02", help="s to wait after the enforcer logged the "
                    "stall before returning memory (0: as soon as the waiter is stopped); a list runs each")
    ap.add_argument("--json", default="docs/img/sched/resume.json")
    ap.add_argument("--tag", default="sched-resume")
    a = ap.parse_args(argv)
    lib = Path(a.lib) if a.lib else build_dir() / "standin" / "libcuda.so.1"
    cap = parse_size(a.capacity, "--capacity")
    env = stand_in_env(f"/{a.tag}-{os.getpid()}", 0, lib)
    env["CONVGPU_STANDIN_CAPACITY"] = str(4 * cap)   # the enforcer's capacity is the limit here
    limits = {"rexa": cap * 3 // 4, "rexb": cap, "rfree": cap, "rload": cap}
    # the stand-in's contexts cost nothing here (stand_in_env's 0) and it has no NVML to measure
    # one: say so, or each context is charged the conservative 1 GiB (enforcer/ctxest.py)
    ctx = () if a.lib else ("--ctx-overhead", "0")
    rates = [int(x) for x in a.rates.split(",")]
    settles = [float(x) for x in a.settle.split(",")]
    res: dict = {}
    with cgroup_dirs(f"{a.tag}-{os.getpid()}", limits) as cgs, \
            enforcer(lib, limits, "--policy", a.policy, *ctx, capacity=cap, tag=a.tag, debug=True) as (enf, log), \
            Progress() as progress:
        try:
            for wait in settles:
                t = progress.add_task(f"exit -> resume, settle {wait:g} s", total=a.trials)
                res[f"exit@{wait:g}"] = summary(exit_case(cgs, lib, env, log, cap, a.trials, wait, progress, t))
            for wait in settles:
                t = progress.add_task(f"free -> resume, settle {wait:g} s", total=a.trials)
                res[f"free@{wait:g}"] = summary(free_case(cgs, lib, env, log, cap, a.trials, wait, progress, t))
            t = progress.add_task("enforcer CPU", total=len(rates))
            res["cpu"] = cpu_case(cgs, lib, env, enf.pid, rates, a.seconds, progress, t)
        except (TimeoutError, EOFError, RuntimeError):
            print("the enforcer's last words:", *(x for _, x in log.lines[-25:]), sep="\n  ", file=sys.stderr)
            raise
    unlink_stand_in(lib, env)
    res["meta"] = {"date": time.strftime("%Y-%m-%d"), "lib": str(lib), "host": platform.node(),
                   "cpus": os.cpu_count(), "kernel": platform.release(),
                   "command": "python -m bench.sched.resume " + " ".join(argv if argv is not None else sys.argv[1:])}
    for case in [k for k in res if "@" in k]:
        if "during_teardown" in res[case]:
            print(f"{case:10} resumed during the exiting process's teardown in "
                  f"{res[case]['during_teardown']} of {a.trials} trials")
        for key, r in res[case].items():
            if key == "during_teardown":
                continue
            print(f"{case:10} {key:16} p50 {r['p50']:8.3f} ms  p99 {r['p99']:8.3f} ms  "
                  f"max {r['max']:8.3f} ms  ({r['n']} trials)")
    for r in res["cpu"]:
        print(f"enforcer CPU at {r['rate']:8.0f} allocs/s: {r['cpu_pct']:5.2f} % of one core "
              f"({r['cpu_s']:.2f} s in {r['wall_s']:.1f} s)")
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
