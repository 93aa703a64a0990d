"""Swap (issue 46): how fast the driver moves a process's GPU memory to host memory and back, and
what it saves a waiter. Two parts, one JSON:

1. rates: a holder (build/holder, the driver API) of 1, 4 and 16 GiB; the checkpoint agent
   (enforcer/swap/agent.py, as the enforcer runs it) locks, checkpoints, restores and unlocks it;
   each step timed, NVML's bytes for it before, while out and after, and its bytes checked
   (CRC-32) after: GiB/s out and in.
2. wait: `convgpu enforce --gpu-memory CAP` with two containers that each take 60 % of CAP: A
   allocates and idles, B asks. Without --swap-idle B waits until A exits (after --hold s); with
   --swap-idle 1 A goes out and B runs. B's wait both ways, and A's bytes after it comes back.

    python3 -m bench.swap [--sizes 1,4,16] [--cap 8GiB] [--hold 20] [--driver PATH] --json F

Runs on a GPU host (the real driver) or on the stand-in (LD_LIBRARY_PATH=build/standin,
CONVGPU_STANDIN_BACKED=1: the mechanism, not the driver's rate)."""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

GiB = 1 << 30
DRIVERS = ("/usr/local/nvidia/lib64/libcuda.so.1", "/lib/x86_64-linux-gnu/libcuda.so.1",
           "/usr/lib/x86_64-linux-gnu/libcuda.so.1", "/lib/libcuda.so.1")


def driver_path(given: str | None) -> str:
    if given:
        return given
    std = os.environ.get("LD_LIBRARY_PATH", "").split(":")[0]
    for p in ([os.path.join(std, "libcuda.so.1")] if std else []) + list(DRIVERS):
        if os.path.exists(p):
            return os.path.realpath(p)
    raise SystemExit("no libcuda.so.1: give --driver")


def nvml_bytes(pid: int) -> int | None:
    try:
        import pynvml
        pynvml.nvmlInit()
        try:
            h = pynvml.nvmlDeviceGetHandleByIndex(0)
            return sum(p.usedGpuMemory or 0 for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h) if p.pid == pid)
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return None


class Proc:
    """A child speaking one line at a time."""

    def __init__(self, argv, env=None):
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def line(self) -> str:
        return self.p.stdout.readline().strip()

    def ask(self, text: str) -> str:
        self.p.stdin.write(text + "\n")
        self.p.stdin.flush()
        return self.line()

    def close(self):
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait()


def holder(build: str, size: int, env=None) -> tuple[Proc, dict]:
    h = Proc([f"{build}/holder", "-s", str(size)], env=env)
    ready = h.line()
    if not ready.startswith("ready"):
        h.close()
        raise SystemExit(f"holder: {ready!r}")
    return h, dict(kv.split("=") for kv in ready.split()[1:])


def rates(build: str, driver: str, sizes: list[float]) -> list[dict]:
    out = []
    agent = Proc([sys.executable, "-m", "convgpu.enforcer.swap.agent", driver])
    assert json.loads(agent.line()).get("ready"), "the agent could not start"
    try:
        for gib in sizes:
            size = int(gib * GiB)
            h, info = holder(build, size)
            pid = int(info["pid"])
            row = {"gib": gib, "nvml_before": nvml_bytes(pid)}
            for op in ("lock", "checkpoint"):
                r = json.loads(agent.ask(json.dumps({"op": op, "pid": pid, "timeout_ms": 10000})))
                row[f"{op}_s"], row[f"{op}_rc"] = r["s"], r["rc"]
            row["nvml_out"] = nvml_bytes(pid)
            for op in ("restore", "unlock"):
                r = json.loads(agent.ask(json.dumps({"op": op, "pid": pid})))
                row[f"{op}_s"], row[f"{op}_rc"] = r["s"], r["rc"]
            row["nvml_after"] = nvml_bytes(pid)
            row["check"] = h.ask("check")
            row["out_gib_s"] = round(gib / row["checkpoint_s"], 2) if row["checkpoint_s"] else None
            row["in_gib_s"] = round(gib / row["restore_s"], 2) if row["restore_s"] else None
            print(json.dumps(row), flush=True)
            out.append(row)
            h.close()
    finally:
        agent.close()
    return out


def waited(build: str, cap: int, hold: float, swap_idle: float | None) -> dict:
    """B's wait for 60 % of cap while A holds 60 % and idles (A exits after `hold` s)."""
    run = tempfile.mkdtemp(prefix="convgpu-bench-swap-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    share = int(cap * 0.6)
    args = [sys.executable, "-m", "convgpu.cli.main", "enforce", "--run-dir", run, "--state-dir", run,
            "--gpu-memory", f"{cap}B", "--limit", f"a={cap}B", "--limit", f"b={cap}B", "--ctx-overhead", "0"]
    if swap_idle is not None:
        args += ["--swap-idle", str(swap_idle)]
    enf = subprocess.Popen(args, stderr=subprocess.PIPE, text=True)
    log = []
    while True:
        line = enf.stderr.readline()
        log.append(line)
        if "enforcing:" in line or not line:
            break
    from convgpu.enforcer.tenants.containers import cgroup_layout
    base = os.path.join(cgroup_layout().v2_root, f"convgpu-bench-swap-{os.getpid()}")
    row = {"swap_idle": swap_idle, "cap": cap, "share": share, "hold_s": hold}
    a = b = None
    try:
        for name in ("a", "b"):
            os.makedirs(f"{base}/{name}", exist_ok=True)

        def start(name):
            return Proc(["/bin/sh", "-c", f'echo $$ > {base}/{name}/cgroup.procs && exec "$0" "$@"',
                         f"{build}/holder", "-s", str(share)])
        a = start("a")
        assert a.line().startswith("ready")
        t0 = time.monotonic()
        b = start("b")
        deadline = t0 + hold
        got = ""
        import select
        while time.monotonic() < deadline + 60:
            if select.select([b.p.stdout], [], [], 0.05)[0]:
                got = b.line()
                break
            if a.p.poll() is None and time.monotonic() >= deadline:
                a.p.stdin.close()            # A's time is up: it exits, B gets its memory
        row["b_wait_s"] = round(time.monotonic() - t0, 3)
        row["b_ready"] = got.startswith("ready")
        if a.p.poll() is None:               # A is back once B is done
            b.close()
            row["a_check"] = a.ask("check")
    finally:
        for p in (a, b):
            if p:
                p.close()
        enf.terminate()
        enf.wait(timeout=60)
        for name in ("a", "b", ""):
            try:
                os.rmdir(f"{base}/{name}".rstrip("/"))
            except OSError:
                pass
    print(json.dumps(row), flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1,4,16")
    ap.add_argument("--cap", default="8GiB")
    ap.add_argument("--hold", type=float, default=20.0)
    ap.add_argument("--driver")
    ap.add_argument("--json")
    a = ap.parse_args()
    from convgpu.paths import build_dir
    from convgpu.units import parse_size
    from bench.machine import machine
    build = str(build_dir())
    out = {"machine": machine(), "rates": rates(build, driver_path(a.driver), [float(x) for x in a.sizes.split(",")]),
           "wait": [waited(build, parse_size(a.cap, "--cap"), a.hold, None),
                    waited(build, parse_size(a.cap, "--cap"), a.hold, 1.0)]}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
