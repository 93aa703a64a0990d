"""Trace events per second without loss, on the CPU with the stand-in driver.

    python bench/event_throughput.py [--threads 2] [--count 50000]

cgcaller makes THREADS x COUNT allocations and as many frees as fast as it can while the
tracer drains the ring buffer every 100 ms (no per-event wake-ups). Reports events received,
events lost (ring-buffer reservations that failed, counted in BPF), and the rate. The
accounting itself lives in maps, so it is checked exact whatever the event loss."""
import argparse
import os
import subprocess
import sys
import time

from convgpu.paths import build_dir
from convgpu.probes.tracer import Tracer


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--count", type=int, default=50000)
    ap.add_argument("--size", type=int, default=4096)
    a = ap.parse_args()
    b = build_dir()
    env = dict(os.environ, LD_LIBRARY_PATH=str(b / "standin"), CONVGPU_STANDIN_SHM=f"/convgpu-bench-{os.getpid()}")
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
    print(f"threads {a.threads} x {a.count} alloc+free: {got} events received "
          f"(>= {expected} alloc/free expected), {drops} lost, {elapsed:.2f} s, {got / elapsed:,.0f} events/s")
    return 0 if drops == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
