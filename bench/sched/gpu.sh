#!/bin/bash
# The scheduling benchmarks on the GPU machine, about 4 minutes, from the repo root with the
# git-ignored folders .bcc, .wheels and build carried along (see tests/gpu/env.sh):
#   bash bench/sched/gpu.sh        # results in $OUT (default /tmp/convgpu-out)
# 1. issue 3's benchmark on the real driver: exit/free -> resume latency, enforcer CPU at
#    0/1k/10k allocations/s. Capacity 6 GiB: every process's context shows up in NVML as about
#    519 MiB (FACTS.md), which the enforcer charges on top, so 1 GiB (the stand-in's) is too small.
# 2. the scheduling workload, N=6 seed 24, five policies, real processes (cgcaller) on the H100
#    under a 5 GiB virtual capacity; context charged 600 MiB so that NVML's measured ~519 MiB
#    never pushes a container over its limit (size + 600 MiB); the simulator runs the same.
set -u
source tests/gpu/env.sh   # set-up shared with tests/gpu/run-on-gpu.sh
LIB=$(python3 -c 'import os; print(os.path.realpath("/usr/local/nvidia/lib64/libcuda.so.1"))')
cd /tmp
timeout 300 python3 -m bench.sched.resume --lib "$LIB" --capacity 6GiB --trials 50 --settle 0,0.02 --seconds 5 \
  --json "$OUT/sched-resume-h100.json" 2>&1 | grep -v '━' | tee "$OUT/sched-resume-h100.txt"
timeout 150 python3 -m bench.sched.real --lib "$LIB" --overhead 600MiB --n 6 --seed 24 --out "$OUT" \
  2>&1 | tee "$OUT/sched-real-h100.txt"
