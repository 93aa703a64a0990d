"""How late NVML's per-process memory follows an allocation or a free on the real driver: the
enforcer's sampler (probes/nvml.py) takes NVML minus the probes' bytes as a process's context
overhead, so a count that trails a free reads as overhead.

    python3 -m bench.nvml_lag --lib /path/to/libcuda.so.1 [--size 3GiB] [--rounds 20] [--json F]

A worker (bench/sched/worker.py, no probes) allocates and frees SIZE; after each call returns,
NVML is read back to back until the process's count has moved by at least half of SIZE.
Printed: per direction, the time from the call's return (the worker's clock) to the start of the
first read that shows it (p50 / max; where that is the first read of all, the lag is at most
this: the time to hear from the worker), and how long one NVML read takes."""
import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from convgpu.probes.nvml import Nvml
from convgpu.units import parse_size

WORKER = Path(__file__).resolve().parent / "sched" / "worker.py"


def lag_after(nvml: Nvml, pid: int, returned_ns: int, moved, limit_s: float = 5.0):
    """ms from returned_ns until moved(NVML's bytes for pid) holds; and the reads' durations."""
    reads = []
    while True:
        t0 = time.monotonic_ns()
        used = sum(v for (p, _), v in nvml.process_memory().items() if p == pid)
        reads.append((time.monotonic_ns() - t0) / 1e6)
        if moved(used):
            return (t0 - returned_ns) / 1e6, used, reads
        if (t0 - returned_ns) / 1e9 > limit_s:
            return None, used, reads


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lib", required=True)
    ap.add_argument("--size", default="3GiB")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--json")
    a = ap.parse_args()
    size = parse_size(a.size, "--size")
    nvml = Nvml()
    if not nvml.ok:
        print(f"no NVML: {nvml.error}", file=sys.stderr)
        return 1
    w = subprocess.Popen([sys.executable, "-S", str(WORKER), a.lib], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, bufsize=1)

    def ask(line: str, word: str) -> int:
        w.stdin.write(line + "\n")
        w.stdin.flush()
        while not (got := w.stdout.readline()).startswith(word):
            if not got:
                raise RuntimeError(f"worker ended (rc {w.wait()})")
        return int(got.split()[1])

    rows, reads = [], []
    try:
        assert w.stdout.readline().startswith("up")
        time.sleep(0.5)
        base = sum(v for (p, _), v in nvml.process_memory().items() if p == w.pid)
        for _ in range(a.rounds):
            got = ask(f"a {size}", "t ")     # the worker's clock, right after the call returned
            up, _, r1 = lag_after(nvml, w.pid, got, lambda u: u >= base + size // 2)
            freed = ask("f", "ok ")
            down, left, r2 = lag_after(nvml, w.pid, freed, lambda u: u <= base + size // 2)
            rows.append({"alloc_lag_ms": up, "free_lag_ms": down, "left_after_free": left,
                         "reads": [len(r1), len(r2)]})
            reads += r1 + r2
            time.sleep(0.2)
    finally:
        w.kill()
        w.wait()
    out = {"base_bytes": base, "size": size, "rows": rows,
           "read_ms": {"p50": statistics.median(reads), "max": max(reads), "n": len(reads)}}
    for k in ("alloc_lag_ms", "free_lag_ms"):
        v = [r[k] for r in rows if r[k] is not None]
        never = sum(r[k] is None for r in rows)
        out[k] = {"p50": statistics.median(v) if v else None, "max": max(v) if v else None, "never": never}
        p50, top = (f"{out[k][q]:8.3f}" if v else "       -" for q in ("p50", "max"))
        print(f"{k:14s} p50 {p50} ms  max {top} ms  ({len(v)} rounds, {never} never within 5 s)")
    print(f"one NVML read  p50 {out['read_ms']['p50']:.3f} ms  max {out['read_ms']['max']:.3f} ms  "
          f"({len(reads)} reads); process's base {base / 2**20:.0f} MiB")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
