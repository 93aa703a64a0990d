"""End to end, resolved (issue 15): ONE long-running workload, the host's mode switched under it
every few seconds, blocks of steps compared with their bare neighbours (bench/e2e_stats.py).

    python -m bench.e2e_toggle WORKLOAD [--minutes 3] [--blocks N] [--block 8] [--settle 1]
           [--modes probed,enforced] [--delay-us 0 | --delay-frac 0] [--json FILE] [-- WORKLOAD ARGS]
    python -m bench.e2e_toggle WORKLOAD --processes [--modes shim-only] ...

WORKLOAD is one of bench/e2e_workloads.py's (`standin`, `torch`, `jax`); arguments after `--`
go to it (`--lib build/standin/libcuda.so.1` for the stand-in, which also probes only it).
Order: bare, then the other modes each between two bare blocks, the order of the others
reversed every cycle (bare A bare B bare B bare A bare A ...), so every block has bare
neighbours and what follows what cancels. A mode counts from when it is in force in the
workload itself (its libcuda's entry points hooked, or none: bench/e2e_modes.py) plus
`--settle` seconds, and a step counts only if it began and ended inside its block; steps during
attach, the enforcer's start and the detach are dropped. `delay` (the workload busy-waits a
known time per step) is the method's check: its interval must contain the truth.

--processes (the shim, which cannot be switched in a running process): each block is a fresh
workload process, bare or under the mode (`shim-only`: the preload shim under `convgpu enforce
--no-probes`, which runs for the whole measurement, so bare processes run beside it too;
`shim`: the same with the enforcer's probes, then bare processes are probed as well)."""
import argparse
import bisect
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time

from bench import e2e_stats
from bench.e2e_modes import Control, Hooks, Mode, traced
from bench.machine import machine

BENCH_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Workload:
    """The workload process and the end stamps of its steps (a reader thread)."""

    def __init__(self, name: str, args: list, env: dict, control: Control, clock: str = "wall"):
        self.clock = clock
        self.ends: list[int] = []
        self.allocs: list[int] = []
        self.cpu: list[int] = []
        self.refs: list[int] = []   # per step, its reference work's ns (bench/e2e_workloads.py)
        # -P keeps a source tree's convgpu/ from shadowing the installed one; bench/ is found where
        # this module was (the GPU machine puts a folder holding only it on the path)
        path = os.pathsep.join([BENCH_ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
        self.proc = subprocess.Popen([sys.executable, "-P", "-m", "bench.e2e_workloads", name, *args],
                                     stdout=subprocess.PIPE, text=True,
                                     env={**env, "E2E_CONTROL": control.path, "PYTHONPATH": path, "E2E_CLOCK": clock})
        line = self.proc.stdout.readline()
        if not line.startswith("ready "):
            raise SystemExit(f"workload {name} did not start (exit {self.proc.wait()})")
        self.pid = int(line.split()[1])
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            t, a, c, r = line.split()
            self.allocs.append(int(a))
            self.cpu.append(int(c))
            self.refs.append(int(r))
            self.ends.append(int(t))

    def allocs_at(self, t_ns: int) -> int:
        """The workload's own allocations by t_ns (its last step line before it)."""
        i = bisect.bisect_right(self.ends, t_ns)
        return self.allocs[i - 1] if i else 0

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        self.proc.send_signal(signal.SIGCONT)   # a stopped workload ends too
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")


def schedule(modes: list[str]):
    """bare, A, bare, B, bare, B, bare, A, ... for ever (the caller stops after a bare)."""
    k = 0
    while True:
        for m in (modes if k % 2 == 0 else modes[::-1]):
            yield "bare"
            yield m
        k += 1


def block_of(w: Workload, mode: str, start_ns: int, stop_ns: int, **extra) -> dict:
    ends, allocs, cpu, refs = list(w.ends), list(w.allocs), list(w.cpu), list(w.refs)
    durs = e2e_stats.steps_in(ends, start_ns, stop_ns, cpu[:len(ends)] if w.clock == "cpu" else None)
    refs = e2e_stats.refs_in(ends, refs[:len(ends)], start_ns, stop_ns)
    if len(durs) < 3:   # a stall, or steps longer than the block: kept aside, and said
        print(f"dropped: a {mode} block of {(stop_ns - start_ns) / 1e9:.1f} s held {len(durs)} steps",
              file=sys.stderr, flush=True)
        return {"mode": mode, "start_ns": start_ns, "stop_ns": stop_ns, "steps": len(durs), "dropped": True, **extra}
    inside = [a for t, a in zip(ends, allocs) if start_ns <= t <= stop_ns]
    rate = (inside[-1] - inside[0]) / ((stop_ns - start_ns) / 1e9) if inside and inside[-1] else None
    return {"mode": mode, "start_ns": start_ns, "stop_ns": stop_ns, "steps": len(durs),
            "median_ns": statistics.median(durs), "own_alloc_rate": rate, "durations_ns": durs,
            "norm_median": statistics.median(d / r for d, r in zip(durs, refs)),
            "ref_median_ns": statistics.median(refs), **extra}


def toggled(a, w: Workload, control: Control, libs: tuple, deadline: float, blocks: list, dropped: list) -> None:
    hooks = Hooks(w.pid)
    hooks.wait(probed=False, timeout=a.detach_timeout)   # nobody else probes this library
    longest: dict = {}
    settle = int(a.settle * 1e9)
    delay_ns = int(a.delay_us * 1000)
    for mode in schedule(a.modes):
        if mode != "bare" and a.blocks and sum(b["mode"] != "bare" for b in blocks + dropped) >= a.blocks:
            break
        if mode != "bare":
            # room for this block and the bare one that must close it, at the longest seen so far
            first = 30.0 if mode in ("probed", "enforced") else a.block + a.settle   # a guess until seen
            need = longest.get(mode, first) + longest.get("bare", a.block + a.settle)
            if time.monotonic() + need > deadline:
                break
        if mode == "delay" and a.delay_frac:
            delay_ns = int(a.delay_frac * blocks[0]["median_ns"])
        m = Mode(mode, w.pid, libs, a.standin, control, delay_ns, a.place_timeout)
        t0 = time.monotonic()
        try:
            m.start()
            if m.probes:
                hooks.wait(probed=True, timeout=60)
            ready_s = time.monotonic() - t0
            start = time.monotonic_ns() + settle
            time.sleep(a.settle + a.block)
            stop = time.monotonic_ns()
            seized = traced(w.pid)   # still held by the enforcer's ptrace holder, long after its linger
            t1 = time.monotonic()
        finally:   # also on SIGTERM or an error: no enforcer or tracer outlives the harness
            m.stop()
        gone_s = hooks.wait(probed=False, timeout=a.detach_timeout) if m.probes else 0.0
        off_s = time.monotonic() - t1
        if m.probes and stopped(w.pid):
            # seen on the stand-in under a load of 35: stopped at its first admitted call for a
            # placement that had not come when the enforcer was told to end, and left stopped
            print(f"the workload was left stopped after {mode}: SIGCONT", file=sys.stderr, flush=True)
            os.kill(w.pid, signal.SIGCONT)
            m.info["left_stopped"] = True
        b = block_of(w, mode, start, stop, ready_s=ready_s, off_s=off_s, detach_wait_s=gone_s,
                     traced_at_stop=seized, **m.info)
        if mode == "delay":
            b["delay_ns"] = delay_ns
        if mode == "probed":
            b.update(m.traced(w))
        longest[mode] = max(longest.get(mode, 0.0), time.monotonic() - t0)
        (dropped if b.get("dropped") else blocks).append(b)
        if not b.get("dropped"):
            print(f"{len(blocks):3d} {mode:>9} {b['steps']:6d} steps, median {b['median_ns'] / 1e6:.4f} ms, "
                  f"ready {ready_s:.2f} s, off {off_s:.2f} s{', ptrace-seized at its end' if seized else ''}",
                  file=sys.stderr, flush=True)
        a.save(blocks, dropped)


def processes(a, env: dict, control: Control, libs: tuple, deadline: float, blocks: list, dropped: list) -> None:
    """A fresh workload per block: bare, or under a shim mode (one enforcer for all of them)."""
    from convgpu.cli.shim import shim_env
    from bench.modes import start_enforcer
    enf, run_dir = start_enforcer(libs, a.standin, probes=a.modes != ["shim-only"])
    try:
        for mode in schedule(a.modes):
            if mode != "bare" and a.blocks and sum(b["mode"] != "bare" for b in blocks + dropped) >= a.blocks:
                break
            if mode != "bare" and blocks and time.monotonic() + 2.2 * blocks[-1]["wall_s"] > deadline:
                break
            t0 = time.monotonic()
            w = Workload(a.workload, a.args, {**env, **(shim_env(run_dir) if mode != "bare" else {})}, control, a.clock)
            start = time.monotonic_ns() + int(a.settle * 1e9)
            time.sleep(a.settle + a.block)
            stop = time.monotonic_ns()
            w.stop()
            b = block_of(w, mode, start, stop, wall_s=time.monotonic() - t0, pid=w.pid)
            (dropped if b.get("dropped") else blocks).append(b)
            if not b.get("dropped"):
                print(f"{len(blocks):3d} {mode:>9} process {w.pid}: {b['steps']} steps, median "
                      f"{b['median_ns'] / 1e6:.4f} ms", file=sys.stderr, flush=True)
            a.save(blocks, dropped)
    finally:
        enf.terminate()
        enf.wait(timeout=120)


def run(a) -> dict:
    libs = tuple(a.args[a.args.index("--lib") + 1:][:1]) if "--lib" in a.args else ()
    a.standin = a.workload == "standin"
    env = dict(os.environ)
    if a.no_caching:
        env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
    control = Control()
    t_start = time.monotonic()
    deadline = t_start + 60 * a.minutes
    blocks: list = []
    dropped: list = []
    head = {"workload": a.workload, "args": a.args, "no_caching": a.no_caching, "processes": a.processes,
            "standin": a.standin, "minutes": a.minutes, "max_blocks": a.blocks, "clock": a.clock, "block_s": a.block, "settle_s": a.settle,
            "machine": machine(), "label": a.label or a.workload + (" (no caching)" if a.no_caching else "")}

    def save(blocks, dropped):   # after every block: a run cut short by a time limit keeps them
        if a.json:
            with open(a.json, "w") as f:
                json.dump({**head, "partial": True, "blocks": blocks, "dropped": dropped}, f)
    a.save = save
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # a time limit's TERM: stop the modes first
    try:
        if a.processes:
            processes(a, env, control, libs, deadline, blocks, dropped)
        else:
            w = Workload(a.workload, a.args, env, control, a.clock)
            try:
                toggled(a, w, control, libs, deadline, blocks, dropped)
            finally:
                w.stop()
    finally:
        control.close()
    return {**head, "wall_s": time.monotonic() - t_start, "modes": e2e_stats.summarize_run(blocks), "blocks": blocks,
            "dropped": dropped}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("workload", choices=("standin", "torch", "jax"))
    ap.add_argument("--minutes", type=float, default=3.0, help="the whole measurement, transitions included")
    ap.add_argument("--blocks", type=int, default=0, help="stop after this many blocks besides bare (0: --minutes decides)")
    ap.add_argument("--block", type=float, default=8.0, help="seconds measured per block")
    ap.add_argument("--settle", type=float, default=1.0, help="seconds dropped after a mode is in force")
    ap.add_argument("--modes", default="probed,enforced", help="besides bare: delay, probed, enforced; "
                    "with --processes: shim-only or shim")
    ap.add_argument("--delay-us", type=float, default=0.0, help="delay mode: busy-wait per step")
    ap.add_argument("--delay-frac", type=float, default=0.0, help="delay mode: that fraction of the first bare block's median")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="step times in wall time, or the "
                    "workload thread's CPU time (a shared CPU host, where other processes' load stretches wall time)")
    ap.add_argument("--no-caching", action="store_true", help="PYTORCH_NO_CUDA_MEMORY_CACHING=1 for the workload")
    ap.add_argument("--processes", action="store_true", help="a fresh workload process per block (the shim)")
    ap.add_argument("--place-timeout", type=float, default=3.0, help="enforced: longest wait for the enforcer to "
                    "place the workload (a workload that makes no admitted call is never placed)")
    ap.add_argument("--detach-timeout", type=float, default=180.0, help="longest wait for probes to leave")
    ap.add_argument("--label", help="the plot's panel title")
    ap.add_argument("--json", help="write everything (blocks with their step times) here")
    a = ap.parse_args(argv)
    a.args, a.modes = extra, a.modes.split(",")
    res = run(a)
    print(f"{res['label']}: {len(res['blocks'])} blocks in {res['wall_s']:.0f} s")
    print(e2e_stats.table(res["modes"]))
    if "truth_ratio" in res["modes"].get("delay", {}):
        d = res["modes"]["delay"]
        print(f"delay: injected {d['truth_added_us']:.2f} us per step = ratio {d['truth_ratio']:.5f}; "
              f"recovered {d['ratio']:.5f} [{d['ratio_lo']:.5f}, {d['ratio_hi']:.5f}], "
              f"{d['added_us']:.2f} us [{d['added_lo_us']:.2f}, {d['added_hi_us']:.2f}]")
        if "norm_truth_ratio" in d:
            print(f"delay, steps over their reference work: ratio {d['norm_truth_ratio']:.5f}; recovered "
                  f"{d['norm_ratio']:.5f} [{d['norm_lo']:.5f}, {d['norm_hi']:.5f}]")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
