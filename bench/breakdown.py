"""Issue 32 part 1: where the microseconds of one no-caching allocation+free pair go, in one run.

    python -m bench.breakdown [--standin] [--workload torch|cupy|driver|runtime] [--pairs N]
        [--rounds R] [--sizes 4K,64K,...] [--hold 1] [--json FILE]

One workload process (bench/breakdown_child.py: PyTorch with PYTORCH_NO_CUDA_MEMORY_CACHING=1
making tensors of --sizes, default 4 KiB, CuPy without its pool, or a plain driver-API /
runtime-API loop through ctypes; on --standin the stand-in's driver and runtime) runs a timed block of --pairs allocation+free pairs
in each mode, the modes one after another in every round (attach, block, detach), so drift hits
all alike. The modes add one layer of probes at a time, so that each step's increment is a
measured cost:

    bare       nothing attached (checked: no int3 on any entry point, bench/e2e_modes.py Hooks)
    traps      empty BPF programs on the entry and return of the pair's calls (cuMemAlloc_v2,
               cuMemFree_v2, and cudaMalloc, cudaFree where a runtime is given): the trap alone
    drv-entry  the tracer's program (with its openat/sched tracepoints) and the driver's entry
               probes only (the table's exits dropped: probes/table.py)
    drv-ret    + the driver's return probes (a free's: a uprobe session, which skips the return
               where it cannot matter, Linux >= 6.13; its runs count as entry traps)
    runtime    + the runtime's probes (libcudart, entry and return): the tracer's whole table
    enforced   `convgpu enforce` as bench/modes.py starts it (no limit reached, nothing stalls)

The layers are the tracer's own attach lists (probes/loader.attach_library over a filtered
table) and its ring-buffer consumer (Tracer.poll), run in this process. Per mode and pair:
wall time, the workload thread's CPU time, each program's runs and run time (bench/bpf_stats.py:
the kernel's statistics, on for the whole run; they add two clock reads to every program run),
ring records (the ring buffer's producer position, read from its mmapped page) and, for the
tracer, the consumer's wake-ups, for the enforcer its CPU time, context switches and CPUs.
Beside the workload an unrelated process times a loop of openat+close and one of fork+exit
(what every process on the host pays for the tracepoints).

Increments are medians over rounds of the differences within a round, the total is the
median of (enforced - bare); the remainder is what the steps do not add up to. On the H100
bare itself varies 1.1-2.1 us a call from run to run (FACTS.md): compare within one run. And
there an alternating pair costs the driver 77-93 us even at 4 KiB (each maps and unmaps device
pages; bench/alloc_bench.c holds its allocations in batches for that reason), so the steps
were noise around a few microseconds. The workload therefore keeps --hold blocks (default 1)
for its life, as a framework keeps its weights: the page stays mapped and a pair is a
sub-allocation (--hold 0: the old pattern; docs/BENCHMARKS.md, issue 32)."""
import argparse
import contextlib
import json
import mmap
import os
import select
import shutil
import struct
import subprocess
import sys
import tempfile
import time

from convgpu.paths import build_dir
from convgpu.units import parse_size

from bench import bpf_stats
from bench.breakdown_report import MODES, summarize, table
from bench.machine import machine

WORKLOADS = ("torch", "cupy", "driver", "runtime")
BPF_MAP_GET_FD_BY_ID = 14
TRAPPED = {"cuda": (b"cuMemAlloc_v2", b"cuMemFree_v2"), "cudart": (b"cudaMalloc", b"cudaFree")}
SIZES = (4096,)   # cycled; bench.breakdown --sizes 4K,16K,64K,256K,1M for a framework's mix

def workload_env(standin: bool, cudart: str | None = None) -> tuple[dict, str, str | None, str | None]:
    """(environment, libcuda, libcudart, the stand-in's copy to remove or None) for a Workload:
    the host's driver, or a copy of the stand-in of its own (uprobes are per inode: a test or
    helper probing the build's stand-in would otherwise hook, and count, this workload too)."""
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    copy = None
    if standin:
        copy = tempfile.mkdtemp(prefix="convgpu-workload-")
        shutil.copytree(build_dir() / "standin", copy, symlinks=True, dirs_exist_ok=True)
        env["LD_LIBRARY_PATH"] = copy
        libcuda = os.path.join(copy, "libcuda.so.1")
        cudart = cudart or os.path.join(copy, "libcudart.so.13")
    else:
        from convgpu.probes.libs import system_drivers
        from bench.probe_latency import find_cudart
        libcuda = os.path.realpath((system_drivers() or ["libcuda.so.1"])[0])
        cudart = cudart or find_cudart()
    env["BREAKDOWN_LIBCUDA"] = libcuda
    if cudart:
        env["CONVGPU_CUDART"] = cudart
    return env, libcuda, cudart, copy


class Workload:
    def __init__(self, kind: str, env: dict, sizes=SIZES, hold: int = 0):
        self.p = subprocess.Popen([sys.executable, "-m", "bench.breakdown_child", "pairs", kind,
                                   ",".join(map(str, sizes)), str(hold)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        words = self.p.stdout.readline().split()
        if words[:1] != ["ready"]:
            raise SystemExit(f"the {kind} workload did not start (exit {self.p.wait()})")
        self.pid = int(words[1])

    def block(self, pairs: int, while_waiting=lambda: None) -> tuple[int, int]:
        """(wall ns, CPU ns) of `pairs` pairs; while_waiting() runs whenever nothing came yet."""
        self.p.stdin.write(f"{pairs}\n")
        self.p.stdin.flush()
        while not select.select([self.p.stdout], [], [], 0.05)[0]:
            while_waiting()
        wall, cpu = self.p.stdout.readline().split()
        return int(wall), int(cpu)

    def close(self):
        self.p.stdin.close()
        self.p.wait(timeout=60)


def ring_position(pid: int) -> int | None:
    """The producer position of the ring buffer(s) that pid (or its children) holds: bytes
    written so far (each record is its size rounded to 8, plus an 8-byte header)."""
    total, found, seen = 0, False, set()
    for info in bpf_stats.held(pid, "map"):
        if info.get("map_type") != "27" or info["map_id"] in seen:   # BPF_MAP_TYPE_RINGBUF, once each
            continue
        seen.add(info["map_id"])
        mfd = bpf_stats._bpf(BPF_MAP_GET_FD_BY_ID, struct.pack("<III", int(info["map_id"]), 0, 0))
        try:
            page = mmap.mmap(mfd, mmap.PAGESIZE, mmap.MAP_SHARED, mmap.PROT_READ,
                             offset=mmap.PAGESIZE)   # the producer page
            total += struct.unpack_from("<Q", page, 0)[0]
            page.close()
            found = True
        finally:
            os.close(mfd)
    return total if found else None


def proc_cpu(pid: int) -> tuple[int, int, list[int], dict]:
    """(CPU ns, voluntary context switches, CPUs last run on, {thread name: [CPU ns, switches]})
    of pid and its children, all threads (named in the kernel: convgpu/threads.py):
    schedstat's run time is in ns (/proc/PID/stat's utime+stime tick at 10 ms, longer than the
    enforcer's whole share of a block)."""
    ns, cs, cpus, by = 0, 0, [], {}
    for p in [pid] + bpf_stats.children(pid):
        try:
            for t in os.listdir(f"/proc/{p}/task"):
                tns = int(open(f"/proc/{p}/task/{t}/schedstat").read().split()[0])
                st = dict(line.split(":", 1) for line in open(f"/proc/{p}/task/{t}/status"))
                tcs = int(st["voluntary_ctxt_switches"])
                ns, cs = ns + tns, cs + tcs
                name = f"{'' if p == pid else 'child '}{st['Name'].strip()}"
                have = by.setdefault(name, [0, 0])
                have[0], have[1] = have[0] + tns, have[1] + tcs
            cpus.append(int(open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[36]))   # processor
        except OSError:
            continue
    return ns, cs, cpus, by


@contextlib.contextmanager
def layer(mode: str, libs: tuple, standin: bool, pids: list):
    """The tracer with the mode's part of the table, in this process (yields it), or the enforcer
    (yields None), or nothing (bare)."""
    from convgpu.probes import detach, loader
    from convgpu.probes.table import CUDA
    from convgpu.probes.tracer import Tracer
    from dataclasses import replace
    from bench.modes import running
    if mode == "bare":
        yield None
        return
    if mode == "traps":
        b = loader.import_bcc().BPF(text=b"int empty(void *ctx) { return 0; }")
        try:
            for path, syms in ((libs[0], TRAPPED[CUDA]),) + (((libs[1], TRAPPED["cudart"]),) if libs[1:] else ()):
                for sym in syms:
                    b.attach_uprobe(name=path.encode(), sym=sym, fn_name=b"empty")
                    b.attach_uretprobe(name=path.encode(), sym=sym, fn_name=b"empty")
            pids.append(os.getpid())
            yield None
        finally:
            b.cleanup()
        return
    if mode == "enforced":
        with running("enforced", libs, standin, pids=pids):
            yield None
        return
    table = loader.PROBES
    if mode != "runtime":
        table = tuple(p for p in table if p.library == CUDA)
    if mode == "drv-entry":
        table = tuple(replace(p, exit=None, session=None) for p in table)
    tracer = None
    try:
        loader.PROBES = table
        tracer = Tracer(libraries=libs if mode == "runtime" else libs[:1], discover=False, selftest=False).start()
        pids.append(os.getpid())
        yield tracer
    finally:
        loader.PROBES = sys.modules["convgpu.probes.table"].PROBES
        if tracer:
            tracer.close()
        if not detach.wait_all(timeout=300):
            raise SystemExit("probes of the last mode still detaching after 300 s")


def measure(mode: str, w: Workload, a, libs: tuple, bystander_n: int) -> dict:
    from bench.e2e_modes import Hooks
    pids: list = []
    with layer(mode, libs, a.standin, pids) as tracer:
        hooks = Hooks(w.pid)
        hooked = sorted(hooks.hooked())
        if mode == "bare" and hooked:
            raise SystemExit(f"bare, yet hooked: {', '.join(hooked)} (another tracer on this library?)")
        if mode != "bare" and not any(h.endswith(":cuMemAlloc_v2") for h in hooked):
            raise SystemExit(f"{mode}: cuMemAlloc_v2 is not hooked in the workload")
        counted = {"events": 0, "wakeups": 0}

        def consume():   # as `convgpu trace` does: a poll every 50 ms, and whenever BPF wakes it
            if tracer is not None:
                counted["wakeups"] += bool(select.select([tracer.fileno()], [], [], 0)[0])
                counted["events"] += sum(1 for e in tracer.poll() if e.pid == w.pid)
        w.block(max(1, a.pairs // 10), consume)   # warm: the enforcer places the workload here
        consume()
        if mode == "enforced":
            out_of_holder(w.pid)
        counted.update(events=0, wakeups=0)
        owner = pids[0] if pids else None
        s0 = bpf_stats.snapshot(owner) if owner else {}
        r0 = ring_position(owner) if owner else None
        e0 = proc_cpu(owner) if mode == "enforced" else None
        wall, cpu = w.block(a.pairs, consume)
        e1 = proc_cpu(owner) if mode == "enforced" else None
        r1 = ring_position(owner) if owner else None
        s1 = bpf_stats.snapshot(owner) if owner else {}
        consume()
        opens_ns, fork_ns = (float(x) for x in subprocess.run(
            [sys.executable, "-m", "bench.breakdown_child", "bystander", str(bystander_n)], capture_output=True, text=True,
            check=True).stdout.split())
    from convgpu.probes.events import FORMAT
    out = {"pair_ns": wall / a.pairs, "cpu_ns": cpu / a.pairs, "hooked": len(hooked),
           "programs": {k: {"runs_per_pair": v["runs"] / a.pairs, "ns_per_run": v["ns_per_run"]}
                        for k, v in bpf_stats.delta(s0, s1).items()},
           "openat_ns": opens_ns, "fork_exit_ns": fork_ns}
    if r0 is not None and r1 is not None:
        out["ring_records_per_pair"] = (r1 - r0) / ((FORMAT.size + 7) // 8 * 8 + 8) / a.pairs
    if tracer is not None:
        out["wakeups_per_pair"] = counted["wakeups"] / a.pairs
        out["events_per_pair"] = counted["events"] / a.pairs
    if e0 and e1:
        out["enforcer"] = {"cpu_ns_per_pair": (e1[0] - e0[0]) / a.pairs, "switches_per_pair": (e1[1] - e0[1]) / a.pairs,
                           "cpus": e1[2], "workload_cpu": proc_cpu(w.pid)[2],
                           "threads": {k: {"cpu_ns_per_pair": (e1[3].get(k, [0, 0])[0] - e0[3].get(k, [0, 0])[0]) / a.pairs,
                                           "switches_per_pair": (e1[3].get(k, [0, 0])[1] - e0[3].get(k, [0, 0])[1]) / a.pairs}
                                       for k in e0[3].keys() | e1[3].keys()}}   # a thread gone: its share negative, as in the total
    return out


def out_of_holder(pid: int, timeout: float = 10.0) -> None:
    """Waits until no thread of pid is ptrace-seized. A workload with threads of its own (any
    CUDA process: the driver's) is seized by the enforcer's holder at its placement stop and let
    go 0.5 s after (enforcer/failsafe/threadhold.py LINGER), polled every 0.5 ms meanwhile: a block
    measured inside that linger counted its ~2,000 wake-ups a second as the enforcer's cost per
    pair (the H100, 2026-11-27: 12 us of CPU a pair, against 0.5 us in steady state on the H200)."""
    from bench.e2e_modes import traced
    deadline = time.monotonic() + timeout
    while traced(pid):
        if time.monotonic() > deadline:
            raise SystemExit(f"the workload (pid {pid}) is still ptrace-seized {timeout:.0f} s after its placement")
        time.sleep(0.05)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--standin", action="store_true")
    ap.add_argument("--workload", choices=WORKLOADS, help="default: driver (torch without --standin)")
    ap.add_argument("--pairs", type=int, default=20000, help="allocation+free pairs per block")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sizes", default="4K", help="allocation sizes, cycled (default 4K)")
    ap.add_argument("--hold", type=int, default=1, help="blocks of the first size the workload keeps for its life "
                    "(0: none, every pair maps and unmaps a device page on a real driver)")
    ap.add_argument("--bystander", type=int, default=20000, help="openat+close calls of the unrelated process")
    ap.add_argument("--cudart", help="the libcudart probed in the runtime layer (default: the workload's)")
    ap.add_argument("--json", help="write results here (after every round)")
    a = ap.parse_args(argv)
    sizes = tuple(parse_size(x) for x in a.sizes.split(","))
    kind = a.workload or ("driver" if a.standin else "torch")
    if a.standin and kind in ("torch", "cupy"):
        raise SystemExit(f"--workload {kind} needs the GPU: on the stand-in use driver or runtime")
    env, libcuda, cudart, standin = workload_env(a.standin, a.cudart)
    libs = (libcuda,) + ((os.path.realpath(cudart),) if cudart else ())
    meta = {"workload": kind, "pairs": a.pairs, "rounds": a.rounds, "standin": a.standin, "libs": libs, "hold": a.hold,
            "sizes": sizes, "argv": sys.argv[1:] if argv is None else argv, "machine": machine()}
    w = Workload(kind, env, sizes, a.hold)
    rounds: list = []
    try:
        with bpf_stats.enabled():
            for r in range(a.rounds):
                rounds.append({m: measure(m, w, a, libs, a.bystander) for m in MODES})
                print(f"round {r + 1}/{a.rounds} done", file=sys.stderr)
                res = summarize(meta, rounds)
                if a.json:
                    with open(a.json, "w") as f:
                        json.dump(res, f, indent=1)
    finally:
        w.close()
        if standin:
            shutil.rmtree(standin, ignore_errors=True)
    print(table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
