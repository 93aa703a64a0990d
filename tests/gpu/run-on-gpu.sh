#!/bin/bash
# How the runs in docs/gpu-runs/ are made, on the GPU machine (set-up: tests/gpu/env.sh):
#   OUT=... bash tests/gpu/run-on-gpu.sh [pytest args]      # tests, then the latency bench
# NO_BENCH=1 skips the bench; NO_TESTS=1 the tests; E2E=1 adds bench.e2e (about 4 minutes);
# E2E_TOGGLE="torch torch-nocache jax torch-shim" adds bench.e2e_toggle, E2E_MINUTES (default 3)
# per workload, one JSON each ($OUT/e2e-<workload>.json); E2E_MODES (default probed,enforced,delay),
# E2E_TOGGLE_ARGS (default --block 5 --settle 1 --delay-frac 0.002) go to every toggled one.
# STARTUP=1 adds bench.startup, enforce then trace, 10 starts warm and 10 cold each (about 8 minutes).
set -u
source tests/gpu/env.sh
export CONVGPU_GPU_LOG=$OUT/gpu-results.jsonl CONVGPU_REQUIRE_SYSTEM=1
python3 -m convgpu.cli.main doctor > "$OUT/doctor.txt" 2>&1; grep -i "uprobe\|recheck" "$OUT/doctor.txt"   # links or perf events
[ -n "${NO_TESTS:-}" ] || { timeout ${TEST_TIMEOUT:-360} python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider -rA "$@" > "$OUT/pytest-gpu.txt" 2>&1
  tail -25 "$OUT/pytest-gpu.txt"; }
[ -n "${NO_BENCH:-}" ] || { timeout ${BENCH_TIMEOUT:-230} python3 -m bench.probe_latency ${LATENCY_ARGS:---rounds 3 --iters 500} --json "$OUT/latency.json" > "$OUT/latency.txt" 2>&1; cat "$OUT/latency.txt"; }
[ -z "${E2E:-}" ] || { (cd /tmp && timeout ${E2E_TIMEOUT:-260} python3 -m bench.e2e ${E2E_ARGS:---reps 4} --json "$OUT/e2e.json") > "$OUT/e2e.txt" 2>&1; cat "$OUT/e2e.txt"; }
for w in ${E2E_TOGGLE:-}; do
  x=""
  case $w in
    torch) a="torch" ;;
    torch-nocache) a="torch --no-caching"; x="--block 10" ;;   # every free synchronises: slower steps
    jax) a="jax" ;;
    torch-shim) a="torch --processes --modes shim-only" ;;   # short processes: the shim can't be toggled
    *) echo "unknown E2E_TOGGLE workload $w"; continue ;;
  esac
  m=${E2E_MINUTES:-3}
  case $w in *-shim) ;; *) a="$a --modes ${E2E_MODES:-probed,enforced,delay}" ;; esac
  (cd /tmp && timeout $(awk "BEGIN{print int($m * 60 + 30)}") python3 -m bench.e2e_toggle $a --minutes $m ${E2E_TOGGLE_ARGS:---block 5 --settle 1 --delay-frac 0.002} $x \
     --json "$OUT/e2e-$w.json") > "$OUT/e2e-$w.txt" 2>&1; tail -8 "$OUT/e2e-$w.txt"
done
[ -z "${STARTUP:-}" ] || for c in enforce trace; do (cd /tmp && timeout ${STARTUP_TIMEOUT:-280} python3 -m bench.startup --command $c ${STARTUP_ARGS:---n 10} --json "$OUT/startup-$c.json" $([ $c = trace ] && echo -- --duration 120)) > "$OUT/startup-$c.txt" 2>&1; cat "$OUT/startup-$c.txt"; done
