"""How long `convgpu enforce` (or `trace`) takes from its exec to work (issue 15.3: <= 1 s p50
of 10 starts on the H100 with a warm cache).

    python3 -m bench.startup [--command enforce|trace] [--n 10] [--modes warm,cold] [--json F]
                             [--warm-cache DIR] [-- extra arguments of the command, e.g. --lib /path/libcuda.so.1]

enforce: exec to the "enforcing:" line, which the enforcer logs once its probes are attached
and self-tested, its watchdog holds them and admission is on (control.enforcing = 1): the first
moment an allocation can be admitted or stalled. trace: exec to its first JSON snapshot (probes
attached and self-tested). Each start is a new process with a run dir of its own; modes
alternate start by start (warm, cold, warm, ...: drift hits both alike):
  warm: the cache of compiled BPF programs holds this program (one unmeasured start fills it;
        --warm-cache: that cache, kept, which an earlier start may have filled already);
  cold: an empty cache: bcc compiles, and the compile is cached (what the first start costs).
Between two starts the previous one's probes are gone: a background detach of perf events
(probes/detach.py: tracepoints, or every probe before Linux 6.6) holds the kernel's event_mutex,
which every such attach needs, for ~0.1 s a probe. The enforcer logs
where its start went (convgpu/phases.py); the medians of those phases come with the totals."""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from bench.machine import machine

READY = {"enforce": "enforcing:", "trace": '"type": "snapshot"'}
PHASES = " s from exec: "    # convgpu/phases.py's line: "start: 0.62 s from exec: imports 0.25, ..."


def command(cmd: str, run_dir: str, extra: list[str]) -> list[str]:
    py = [sys.executable] + (["-P"] if sys.flags.safe_path else []) + ["-m", "convgpu.cli.main", "-v"]
    if cmd == "enforce":
        return py + ["enforce", "--run-dir", run_dir, "--state-dir", run_dir, *extra]
    return py + ["trace", "--json", "--no-events", "--demo", "never", "--run-dir", run_dir, *extra]


def _detachers() -> set[int]:
    """Our background detach children (same interpreter; other users' are not ours to wait for)."""
    out = set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                argv = open(f"/proc/{d}/cmdline", "rb").read().split(b"\0")
            except OSError:
                continue
            if b"convgpu-detach" in argv and argv[0] == sys.executable.encode():
                out.add(int(d))
    return out


def _wait_gone(pids: set[int], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while pids and time.monotonic() < deadline:
        pids = {p for p in pids if os.path.exists(f"/proc/{p}")}
        time.sleep(0.05)


def one_start(cmd: str, extra: list[str], cache: str) -> dict:
    """One start: seconds from exec to ready, and the phases the command logged."""
    run_dir = tempfile.mkdtemp(prefix="convgpu-startup-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    env = dict(os.environ, CONVGPU_BPF_CACHE=cache)
    before = _detachers()
    t0 = time.monotonic()
    # enforce logs both lines on stderr; trace prints its snapshot on stdout, its log on stderr
    p = subprocess.Popen(command(cmd, run_dir, extra), stdout=subprocess.PIPE if cmd == "trace" else subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, env=env)
    ready, log = None, []
    for line in (p.stdout if cmd == "trace" else p.stderr):
        log.append(line.rstrip())
        if ready is None and READY[cmd] in line:
            ready = time.monotonic() - t0
            if cmd == "trace":
                break
        if PHASES in line:
            break
    p.terminate()
    try:
        _, err = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        _, err = p.communicate()
    log += (err or "").splitlines()
    phases = next((x.split("start: ", 1)[1].strip() for x in log if PHASES in x), None)
    _wait_gone(_detachers() - before)
    shutil.rmtree(run_dir, ignore_errors=True)
    if ready is None:
        raise RuntimeError(f"{cmd} never got ready: {log[-10:]}")
    return {"s": round(ready, 4), "phases": phases}


def _phase_seconds(text: str | None) -> dict[str, float]:
    """'0.62 s from exec: imports 0.25, bpf 0.04 (replayed), ...; of which attach 0.15' ->
    {'imports': 0.25, 'bpf': 0.04, ..., 'attach': 0.15}."""
    out = {}
    if not text:
        return out
    for part in text.split(": ", 1)[1].replace("; of which ", ", ").split(", "):
        words = part.split()
        if len(words) >= 2:
            try:
                out[words[0]] = float(words[1])
            except ValueError:
                pass
    return out


def summarize(samples: list[dict]) -> dict:
    secs = [s["s"] for s in samples]
    phases = [_phase_seconds(s["phases"]) for s in samples]
    names = [n for n in phases[0]] if phases and phases[0] else []
    origins = sorted({m.group(1) for s in samples if (m := re.search(r"bpf [\d.]+ \((\w+)\)", s["phases"] or ""))})
    return {"n": len(secs), "p50_s": round(statistics.median(secs), 3), "min_s": round(min(secs), 3),
            "max_s": round(max(secs), 3), "samples_s": secs, "bpf": origins,
            "phases_p50_s": {n: round(statistics.median(p.get(n, 0.0) for p in phases), 3) for n in names}}


def run(cmd: str, n: int, modes: list[str], extra: list[str], warm_cache: str | None = None) -> dict:
    warm = warm_cache or tempfile.mkdtemp(prefix="convgpu-bench-bpfcache-")
    try:
        if "warm" in modes:
            one_start(cmd, extra, warm)   # fills the cache: not measured
        samples = {m: [] for m in modes}
        for i in range(n):
            for m in (modes if i % 2 == 0 else modes[::-1]):
                cache = warm if m == "warm" else tempfile.mkdtemp(prefix="convgpu-bench-bpfcache-")
                try:
                    samples[m].append(one_start(cmd, extra, cache))
                    print(f"{m} {i + 1}/{n}: {samples[m][-1]['s']:.2f} s; {samples[m][-1]['phases']}",
                          file=sys.stderr, flush=True)
                finally:
                    if cache != warm:
                        shutil.rmtree(cache, ignore_errors=True)
    finally:
        if warm != warm_cache:
            shutil.rmtree(warm, ignore_errors=True)
    out = {"command": cmd, "args": extra, "machine": machine(), **{m: summarize(s) for m, s in samples.items()}}
    out["line"] = doc_line(out, modes)
    return out


def doc_line(d: dict, modes: list[str]) -> str:
    what = {"enforce": "exec to admission on", "trace": "exec to the first snapshot"}[d["command"]]
    parts = []
    for m in modes:
        s = d[m]
        ph = ", ".join(f"{k} {v:.2f}" for k, v in s["phases_p50_s"].items())
        parts.append(f"{m} {s['p50_s']:.2f} s" + (f" ({ph})" if ph else ""))
    return f"convgpu {d['command']}, {what}, p50 of {d[modes[0]]['n']}: " + "; ".join(parts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--command", choices=sorted(READY), default="enforce")
    ap.add_argument("--n", type=int, default=10, help="starts per mode")
    ap.add_argument("--modes", default="warm,cold", help="comma-separated: warm, cold")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--warm-cache", help="the warm starts' cache of compiled programs (kept; default: a new one)")
    ap.add_argument("extra", nargs="*", help="after --: arguments for the command")
    a = ap.parse_args(argv)
    modes = [m for m in a.modes.split(",") if m]
    if not modes or set(modes) - {"warm", "cold"}:
        ap.error("--modes takes warm and/or cold")
    d = run(a.command, a.n, modes, a.extra, a.warm_cache)
    print(d["line"])
    if a.json:
        with open(a.json, "w") as f:
            json.dump(d, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
