#!/bin/bash
# How the runs in docs/gpu-runs/ are made, on the GPU machine (Ubuntu 24.04, no network), from
# the repo root with these git-ignored folders carried along:
#   .bcc    = ../shared/gpu-bcc (bcc 0.26 + LLVM 14 + generic headers, FACTS.md)
#   .wheels = pip download --python-version 3.12 --only-binary=:all: -d .wheels \
#             typer rich nvidia-ml-py pyroute2 pytest setuptools
#   build   = `make` output (stand-in driver, cgcaller, alloc_bench; glibc 2.36 binaries run there)
# The machine's python3 has PyTorch; the package and its deps go to a --target folder on
# PYTHONPATH, so that python3 (and the PyTorch child processes) keep their own packages;
# -P keeps the source folder convgpu/ from shadowing the installed package.
set -u
OUT=${OUT:-/tmp/convgpu-out}; mkdir -p "$OUT"
source .bcc/bcc-env.sh
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; uname -r
  python3 -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__)'; } | tee "$OUT/machine.txt"
python3 -m venv /tmp/pipenv >/dev/null && P=/tmp/pipenv/bin/python || P=python3
$P -m pip install -q --no-index --find-links .wheels --target /tmp/pkgs setuptools
PYTHONPATH=/tmp/pkgs $P -m pip install -q --no-index --find-links .wheels --no-build-isolation --upgrade --target /tmp/pkgs '.[test]'
export PYTHONPATH=/tmp/pkgs:$PYTHONPATH CONVGPU_BUILD=$PWD/build CONVGPU_GPU_LOG=$OUT/gpu-results.jsonl CONVGPU_REQUIRE_SYSTEM=1
timeout ${TEST_TIMEOUT:-360} python3 -P -m pytest -m gpu tests/gpu -q -p no:cacheprovider -rA "$@" > "$OUT/pytest-gpu.txt" 2>&1
tail -25 "$OUT/pytest-gpu.txt"
[ -n "${NO_BENCH:-}" ] || { timeout 230 python3 -P bench/probe_latency.py --rounds 3 --iters 1000 --sizes 4K,64K,1M,16M --json "$OUT/latency.json" > "$OUT/latency.txt" 2>&1; cat "$OUT/latency.txt"; }
