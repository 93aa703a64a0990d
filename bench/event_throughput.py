"""Trace events per second without loss, on the CPU with the stand-in driver.

    python -m bench.event_throughput [--threads 2] [--count 50000] [--json FILE]

1. live: cgcaller makes THREADS x COUNT allocations and as many frees as fast as it can while
   the tracer drains the ring buffer every 100 ms (no per-event wake-ups): events received,
   events lost (failed ring-buffer reservations, counted in BPF) and the rate. On a small
   machine this rate is bounded by how fast the caller can call, not by the tracer.
2. burst: the same caller runs while nobody drains (the 16 MiB ring holds ~200 k events),
   then one poll drains everything: the consumer's own rate, decode included."""
import argparse
import json
import os
import subprocess
import sys
import time

from convgpu.paths import build_dir
from convgpu.probes.tracer import Tracer


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--count", type=int, default=50000)
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args(argv)
    b = build_dir()
    env = dict(os.environ, LD_LIBRARY_PATH=str(b / "standin"), CONVGPU_STANDIN_SHM=f"/convgpu-bench-{os.getpid()}")
    try:
        return _run(a, b, env)
    finally:   # the stand-in's segment lives in /dev/shm until unlinked
        subprocess.run([str(b / "standin" / "standin-usage"), "--unlink"], env=env, capture_output=True)


def _run(a, b, env) -> int:
    with Tracer(libraries=(str(b / "standin" / "libcuda.so.1"),), discover=False, selftest=False) as t:
        t.poll()
        drops0 = t.stats()["drops"]
        p = subprocess.Popen([str(b / "cgcaller"), "alloc", "-n", str(a.count), "-s", str(a.size),
                              "-t", str(a.threads)], stdout=subprocess.PIPE, text=True, env=env)
        got, start = 0, time.monotonic()
        while p.poll() is None:
            time.sleep(0.1)
            got += sum(1 for e in t.poll() if e.pid == p.pid)
        elapsed = time.monotonic() - start
        time.sleep(0.2)
        got += sum(1 for e in t.poll() if e.pid == p.pid)
        drops = t.stats()["drops"] - drops0
        expected = 2 * a.count * a.threads
        print(f"live: {a.threads} threads x {a.count} alloc+free: {got} events received "
              f"(>= {expected} expected), {drops} lost, {elapsed:.2f} s, {got / elapsed:,.0f} events/s")
        burst = min(a.count, 45000)   # 2 x 2 x 45000 = 180 k events: fits the ring buffer
        subprocess.run([str(b / "cgcaller"), "alloc", "-n", str(burst), "-s", str(a.size), "-t", "2"],
                       stdout=subprocess.DEVNULL, env=env, check=True)
        start = time.monotonic()
        n = len(t.poll())
        dt = time.monotonic() - start
        lost = t.stats()["drops"] - drops0 - drops
        print(f"burst: drained {n} buffered events in {dt:.3f} s: {n / dt:,.0f} events/s, {lost} lost")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"live": {"expected": expected, "received": got, "lost": drops, "seconds": elapsed},
                       "burst": {"expected": 4 * burst, "received": n, "lost": lost, "seconds": dt}}, f)
    return 0 if drops == 0 and lost == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
