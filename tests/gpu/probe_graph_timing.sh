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
# (nvidia-smi, after SETTLE seconds, default 0.5) and lets it take the next step.
# Then (unless NO_FAMILIES=1) each of cgcaller's issue-39 families once on the real driver, held
# at its peak: its exit status (0: the driver accepted every call) and NVML's figure there. The
# module family loads a cubin with a __device__ array of MODULE_MIB (default 256) MiB, built
# here with nvcc (-arch=native), or CUBIN=FILE. Record the whole output (docs/gpu-runs/, with
# machine.txt).
set -euo pipefail
size=${1:-2G}
build=${CONVGPU_BUILD:-build}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
mkfifo "$dir/go"
exec 3<>"$dir/go"           # held open here: cgcaller's stdin never reads EOF between steps
nvml_of() {
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | awk -F', *' -v p="$1" '$1 == p { print $2 }'
}
"$build/cgcaller" graphprobe -s "$size" --hold < "$dir/go" 2>&1 | while IFS= read -r line; do
  case $line in
  started*)
    pid=${line#started pid=}
    echo "$line driver=$(awk '/libcuda/ { print $6; exit }' "/proc/$pid/maps")" ;;
  step*)
    sleep "${SETTLE:-0.5}"
    echo "$line nvml=$(nvml_of "$pid")"
    echo >&3 ;;
  *) echo "$line" ;;
  esac
done

[ -z "${NO_FAMILIES:-}" ] || exit 0
cubin=${CUBIN:-$dir/device_array.cubin}
if [ -z "${CUBIN:-}" ]; then
  printf '__device__ char a[%d << 20];\nextern "C" __global__ void touch() { a[threadIdx.x] = 1; }\n' \
    "${MODULE_MIB:-256}" > "$dir/device_array.cu"
  nvcc=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
  "$nvcc" -cubin -arch=native -o "$cubin" "$dir/device_array.cu" || echo "nvcc failed: the module family fails too"
fi
for f in "stack -s 64K" "heap -s 1G" "fifo -s 64M" "graph -s 1G -n 2" "capture -s 1G -n 2 -t 2" "module -n 2 --image $cubin"; do
  "$build/cgcaller" $f --hold < "$dir/go" > "$dir/out" 2>&1 &
  cg=$!
  for _ in $(seq 100); do grep -q '^ready' "$dir/out" 2>/dev/null && break; kill -0 $cg 2>/dev/null || break; sleep 0.1; done
  sleep "${SETTLE:-0.5}"
  held=$(nvml_of $cg)
  echo >&3
  rc=0; wait $cg || rc=$?
  echo "family $f: rc=$rc nvml_at_ready=${held:-none} $(grep -v '^ready\|^exit' "$dir/out" | tr '\n' ' ')"
done
