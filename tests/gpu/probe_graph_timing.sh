#!/bin/bash
# Which driver call makes graph memory real? (issue 39: the stand-in takes it at the launch,
# or at the instantiation with CONVGPU_STANDIN_GRAPH_AT=instantiate; this says which the real
# driver does.) On a GPU host, from the repo root, after `make` (build/cgcaller; glibc 2.36
# binaries run there), with the real driver (no stand-in on LD_LIBRARY_PATH: the first line
# names the libcuda the process mapped):
#   bash tests/gpu/probe_graph_timing.sh [SIZE]        # SIZE of the alloc node, default 2G
# `cgcaller graphprobe` takes one step at a time: context; cuCtxSetLimit stack 64 KiB; a graph
# with one alloc node of SIZE; instantiated; launched; memset; exec destroyed; graph destroyed;
# cuDeviceGraphMemTrim; cuMemFree_v2; trimmed again; cuCtxSetLimit heap 4 GiB. After each it
# prints the driver's own graph figures, then this script adds NVML's per-process memory
# (nvidia-smi, after SETTLE seconds, default 0.5) and lets it take the next step. Record the
# whole output (docs/gpu-runs/, with machine.txt).
set -euo pipefail
size=${1:-2G}
build=${CONVGPU_BUILD:-build}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
mkfifo "$dir/go"
exec 3<>"$dir/go"           # held open here: cgcaller's stdin never reads EOF between steps
"$build/cgcaller" graphprobe -s "$size" --hold < "$dir/go" 2>&1 | while IFS= read -r line; do
  case $line in
  started*)
    pid=${line#started pid=}
    echo "$line driver=$(awk '/libcuda/ { print $6; exit }' "/proc/$pid/maps")" ;;
  step*)
    sleep "${SETTLE:-0.5}"
    nvml=$(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader |
           awk -F', *' -v p="$pid" '$1 == p { print $2 }')
    echo "$line nvml=${nvml:-none}"
    echo >&3 ;;
  *) echo "$line" ;;
  esac
done
