"""What fail-closed discovery costs a process's start (issue 14.1: target p99 <= 50 ms).

    python3 -m bench.discovery_cost --lib /path/to/libcuda.so.1 [--starts 100] [--fresh 3] [--json F]

Every process that opens a driver file is stopped at the open until the tracer has looked at
the file's inode (probes/discovery.py). Measured here, in one run: a new process loads the
driver (dlopen, timed inside the process around the load) --starts times with discovery on and
as many with it off, interleaved (on, off, off, on, ...: drift hits both alike); the cost is the
difference of the distributions. The tracer runs in this process, its loop sleeping on the ring
buffer as `trace` and `enforce` do. With --init, each start also calls cuInit, which opens the
GPU's device nodes: discovery by identity stops it there too (probes/identity.py). Then --fresh first sights: each a new copy of the driver
(a new inode), attached and self-tested while the process waits: a one-time cost per file."""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading

from convgpu.probes.tracer import Tracer

LOADER = ("import ctypes, sys, time; t = time.perf_counter(); cu = ctypes.CDLL(sys.argv[1]); "
          "len(sys.argv) > 2 and cu.cuInit(0); print((time.perf_counter() - t) * 1e3)")
INIT = None     # --init DIR: the stand-in's device nodes (CONVGPU_STANDIN_DEVNODES); cuInit opens them


def load_ms(lib: str, pids: list[int]) -> float:
    env = dict(os.environ, CONVGPU_STANDIN_DEVNODES=INIT) if INIT else None
    p = subprocess.Popen([sys.executable, "-S", "-c", LOADER, lib, *(["init"] if INIT else [])],
                         stdout=subprocess.PIPE, text=True, env=env)
    pids.append(p.pid)
    out, _ = p.communicate(timeout=60)
    return float(out)


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def summary(xs: list[float]) -> dict:
    return {"n": len(xs), "p50_ms": round(pct(xs, 0.5), 3), "p99_ms": round(pct(xs, 0.99), 3),
            "max_ms": round(max(xs), 3), "mean_ms": round(statistics.fmean(xs), 3)}


def run(lib: str, starts: int, fresh: int) -> dict:
    lib = os.path.realpath(lib)
    t = Tracer(libraries=(lib,), discover=True, rescan_every=3600).start()
    t.enable_discovery()
    done = threading.Event()

    def loop():   # what trace's and enforce's loops do: sleep on the ring buffer, poll
        while not done.is_set():
            t.wait(0.1)
            t.poll()
    th = threading.Thread(target=loop, daemon=True)
    th.start()
    on, off = [], []
    pids = {True: [], False: []}
    try:
        for i in range(starts):
            for mode in ((True, False) if i % 2 == 0 else (False, True)):
                t.discovery._write(mode)
                (on if mode else off).append(load_ms(lib, pids[mode]))
        t.discovery._write(True)
        stopped = set(t.discovery.recent)   # other processes on the host may open drivers too
        stops = {"on": len(stopped & set(pids[True])), "off": len(stopped & set(pids[False]))}
        first = []
        d = tempfile.mkdtemp(prefix="convgpu-fresh-")
        for k in range(fresh):
            copy = os.path.join(d, str(k), "libcuda.so.1")
            os.makedirs(os.path.dirname(copy))
            shutil.copy(lib, copy)
            first.append(load_ms(copy, []))
        shutil.rmtree(d, ignore_errors=True)
    finally:
        done.set()
        th.join()
        t.close()
    added = [a - b for a, b in zip(sorted(on), sorted(off))]   # quantile differences
    return {"lib": lib, "starts": starts, "stopped_starts": stops, "discovery_on": summary(on),
            "discovery_off": summary(off),
            "added_p50_ms": round(pct(on, 0.5) - pct(off, 0.5), 3),
            "added_p99_ms": round(pct(on, 0.99) - pct(off, 0.99), 3),
            "added_quantiles_max_ms": round(max(added), 3),
            "first_sight": summary(first) if first else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lib", required=True)
    ap.add_argument("--starts", type=int, default=100)
    ap.add_argument("--fresh", type=int, default=3)
    ap.add_argument("--json")
    ap.add_argument("--init", metavar="DIR", help="also time cuInit, which opens the stand-in's device nodes in "
                    "DIR (made with mknod; the tracer matches them with CONVGPU_GPU_MAJORS): the stop at a GPU "
                    "node's open (probes/identity.py) is then in the times")
    a = ap.parse_args(argv)
    global INIT
    INIT = a.init
    r = run(a.lib, a.starts, a.fresh)
    text = json.dumps(r, indent=1)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
