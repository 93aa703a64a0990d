"""What the backstop costs the enforcer (issue 39; enforcer/backstop.py): its CPU while it
samples NVML's per-process memory every 0.25 s with N CUDA processes holding memory, and one
NVML sample's time, against the same enforcer with the sampler at the old 1 s (the
CONVGPU_SAMPLE_EVERY override), in one run. An allocation pays nothing for it: the backstop is
the sampler's thread and the loop, no probe (bench.probe_latency says the same of the probes).
    python -m bench.backstop_cost [--procs 4] [--seconds 20] [--json FILE]
On the stand-in (no GPU): add --standin (the stand-in NVML's per-process lists)."""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one(every: float, procs: int, seconds: float, env: dict, build: Path, standin: bool) -> dict:
    run_dir = tempfile.mkdtemp(prefix="convgpu-bscost-")
    args = [sys.executable, "-m", "convgpu.cli.main", "enforce", "--gpu-memory", "64GiB", "--default-limit", "4GiB",
            "--run-dir", run_dir, "--state-dir", run_dir, "--no-discover"]
    if standin:
        args += ["--lib", str(build / "standin" / "libcuda.so.1"), "--ctx-overhead", "0"]
    enf = subprocess.Popen(args, stderr=subprocess.PIPE, text=True, env=dict(env, CONVGPU_SAMPLE_EVERY=str(every)))
    jobs = []
    try:
        for line in enf.stderr:
            if "enforcing:" in line:
                break
        for _ in range(procs):
            jobs.append(subprocess.Popen([str(build / "cgcaller"), "alloc", "-s", "256M", "--hold"], env=env,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        for j in jobs:
            while not j.stdout.readline().startswith("ready"):
                pass
        time.sleep(2.0)                 # placed, measured: the steady state
        c0, t0 = cpu_s(enf.pid), time.monotonic()
        time.sleep(seconds)
        c1, t1 = cpu_s(enf.pid), time.monotonic()
        return {"sample_every_s": every, "procs": procs, "cpu_pct": round(100 * (c1 - c0) / (t1 - t0), 2)}
    finally:
        for j in jobs:
            j.kill()
            j.wait()
        enf.terminate()
        enf.wait(timeout=30)


def nvml_sample_ms(n: int = 50) -> float | None:
    from convgpu.probes.nvml import Nvml
    nv = Nvml()
    if not nv.ok:
        return None
    t = time.perf_counter()
    for _ in range(n):
        nv.process_memory()
    nv.close()
    return round((time.perf_counter() - t) * 1000 / n, 3)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--standin", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    build = Path(os.environ.get("CONVGPU_BUILD", "build")).resolve()
    env = dict(os.environ)
    if a.standin:
        env.update(LD_LIBRARY_PATH=f"{build}/standin-nvml:{build}/standin", CONVGPU_STANDIN_NVML_PROCS="1")
    res = {"nvml_sample_ms": nvml_sample_ms(), "runs": [one(e, a.procs, a.seconds, env, build, a.standin)
                                                       for e in (0.25, 1.0)]}
    for r in res["runs"]:
        print(f"sampler every {r['sample_every_s']} s, {r['procs']} processes: enforcer CPU {r['cpu_pct']} %")
    print(f"one NVML per-process sample: {res['nvml_sample_ms']} ms")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
