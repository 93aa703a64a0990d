"""Experiment 1: added latency per CUDA memory call, as ratios to bare measured in one run:
probed (the tracer attached), enforced (`convgpu enforce` running, nothing stalls) and shim
(the preload shim under that enforcer: one round trip to it per allocation).

    python -m bench.probe_latency [--standin] [--apis cuMemAlloc_v2,cudaMalloc,...]
        [--sizes 4K,64K,1M,16M,256M] [--iters 1000] [--rounds 3]
        [--modes bare,probed,enforced,shim] [--cudart PATH] [--json FILE]
        [--baseline-pythonpath DIR] [--bpf-stats]

APIs (`build/alloc_bench --list`): cuMemAlloc_v2, cuMemAllocManaged, cuMemAllocPitch_v2,
cuMemCreate+Map (reserve, create, map, set access; freed by unmap, release, address free),
cuMemGetInfo_v2, and the runtime's cudaMalloc, cudaMallocManaged, cudaMallocPitch, cudaMalloc3D
(freed by cudaFree), cudaMemGetInfo; default: every one available. The runtime is the stand-in's
with --standin, else --cudart, else the one in this Python's NVIDIA wheels (PyTorch's), else
whatever libcudart.so.13/.12/.11.0 the loader finds; without one the runtime APIs are reported
unavailable. Its probes are attached explicitly in the probed and enforced modes, as discovery
would once a process maps it.

Each round runs one `build/alloc_bench` process per mode, the modes one after another (attach,
measure, detach, again), so drift of the machine hits all alike; every cell is ITERS calls, each
timed alone. Cells: median over rounds of the per-call median and of the per-call p99, and both
as ratios to bare. The JSON is rewritten after every round, so a run cut short keeps its rounds.
Without --standin the real driver is used (the GPU machine); with it, build/standin.

--baseline-pythonpath DIR adds the modes probed@base and enforced@base (unless --modes names
the modes): the tracer or enforcer run from the package installed in DIR (`pip install --target
DIR` of an older checkout), taking turns with the others in every round, for a before/after
table from one run. --bpf-stats turns on the kernel's BPF run-time statistics (bench/bpf_stats.py)
and reports, per mode, each program's runs and mean run time during the measurement; they add
two clock reads to every program run, so take the latency table from a run without them."""
import argparse
import contextlib
import glob
import importlib.util
import os
import re
import subprocess
import sys

from convgpu.paths import build_dir
from convgpu.units import parse_size

from bench import bpf_stats, latency_report
from bench.machine import machine


def find_cudart() -> str | None:
    """The newest libcudart of the NVIDIA wheels on this Python's path: PyTorch's own runtime
    (nvidia/cu13/lib/libcudart.so.13 for cu130 wheels, nvidia/cuda_runtime/lib/libcudart.so.12
    for cu12x). `nvidia` is a namespace package, so its spec lists every folder of it."""
    spec = importlib.util.find_spec("nvidia")
    folders = (spec.submodule_search_locations or []) if spec else []
    found = [p for d in folders for p in glob.glob(os.path.join(d, "*", "lib", "libcudart.so.*"))]
    return max(found, key=lambda p: [int(x) for x in re.findall(r"\d+", p.rsplit(".so.", 1)[1])], default=None)


def alloc_bench(args: list[str], env: dict) -> list[list[str]]:
    out = subprocess.run([str(build_dir() / "alloc_bench"), *args], env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"alloc_bench {' '.join(args[:3])}... failed ({out.returncode}): {out.stderr.strip()}")
    return [line.split() for line in out.stdout.splitlines()]


def parse_cell(words: list[str]) -> dict:
    """`cell API SIZE key value...` -> {"api", "size", key: int...}."""
    return {"api": words[1], "size": int(words[2]), **{k: int(v) for k, v in zip(words[3::2], words[4::2])}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--standin", action="store_true")
    ap.add_argument("--apis", help="comma-separated (default: every one available)")
    ap.add_argument("--sizes", default="4K,64K,1M,16M,256M")
    ap.add_argument("--iters", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default="bare,probed,enforced,shim,shim-only")
    ap.add_argument("--cudart", help="the libcudart to time (default: see above)")
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--baseline-pythonpath", help="an older install of the package: adds probed@base, enforced@base")
    ap.add_argument("--bpf-stats", action="store_true", help="BPF run time per program and mode")
    a = ap.parse_args(argv)
    sizes = [parse_size(s) for s in a.sizes.split(",")]
    modes = a.modes.split(",")
    if a.baseline_pythonpath and "--modes" not in (argv if argv is not None else sys.argv):
        modes += ["probed@base", "enforced@base"]
    if "bare" not in modes:
        raise SystemExit("--modes must include bare: every cell is a ratio to it")
    env = dict(os.environ)
    libs = []
    if a.standin:
        env["LD_LIBRARY_PATH"] = str(build_dir() / "standin")
        libs.append(str(build_dir() / "standin" / "libcuda.so.1"))
    cudart = a.cudart or (str(build_dir() / "standin" / "libcudart.so.13") if a.standin else find_cudart())
    if cudart:
        env["CONVGPU_CUDART"] = cudart
    listing = alloc_bench(["--list"], env)
    listed = {w[1]: w[2:] for w in listing if w[0] == "api"}   # [kind, "ok"] or [kind, "unavailable", why]
    runtime = next((w[1] for w in listing if w[0] == "runtime"), None)
    apis = a.apis.split(",") if a.apis else list(listed)
    if unknown := [x for x in apis if x not in listed]:
        raise SystemExit(f"unknown API {', '.join(unknown)}: use {', '.join(listed)}")
    unavailable = {x: " ".join(listed[x][2:]) for x in apis if listed[x][1] != "ok"}
    for api, why in unavailable.items():
        print(f"{api}: unavailable ({why})", file=sys.stderr)
    apis = [x for x in apis if x not in unavailable]
    if not apis:
        raise SystemExit("nothing to measure: every API asked for is unavailable")
    if runtime and any(x.startswith("cuda") for x in apis):
        libs.append(os.path.realpath(runtime))   # probed, as discovery would once a process maps it
    cells = [f"{api}:{s}" for api in apis for s in (sizes if listed[api][0] == "alloc" else [0])]
    from bench.modes import package_of, running   # here, not at the top: it imports bcc, which the helpers above need not
    raw: dict = {m: [] for m in modes}   # per mode, per round: the cells as alloc_bench printed them
    meta = {"iters": a.iters, "rounds": a.rounds, "standin": a.standin, "modes": modes, "apis": apis,
            "sizes": sizes, "cudart": runtime, "unavailable": unavailable,
            "argv": sys.argv[1:] if argv is None else argv, "machine": machine(),
            "package": package_of(None)}
    if a.baseline_pythonpath:
        meta["baseline"] = {"pythonpath": a.baseline_pythonpath, "package": package_of(a.baseline_pythonpath)}
    stats: dict = {m: [] for m in modes if m != "bare"} if a.bpf_stats else {}
    with bpf_stats.enabled() if a.bpf_stats else contextlib.nullcontext():
        for r in range(a.rounds):
            for mode in modes:
                pids: list = []
                with running(mode, tuple(libs), a.standin, baseline=a.baseline_pythonpath, pids=pids) as (extra, tracer):
                    before = bpf_stats.snapshot(pids[0]) if mode in stats else None
                    raw[mode].append([parse_cell(w) for w in alloc_bench([str(a.iters), *cells], {**env, **extra})])
                    if mode in stats:
                        stats[mode].append(bpf_stats.delta(before, bpf_stats.snapshot(pids[0])))
                    if tracer:
                        tracer.poll()
            print(f"round {r + 1}/{a.rounds} done", file=sys.stderr)
            result = latency_report.summarize(meta, raw)
            if stats:
                result["bpf_stats"] = stats
            if a.json:
                latency_report.write(a.json, result)
    print(latency_report.table(result))
    if scaled := latency_report.scaled_table(result):
        print("\nat bare's CPU speed (each cell's times x bare's reference work time / its own, same round):")
        print(scaled)
    if stats:
        print(latency_report.bpf_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
