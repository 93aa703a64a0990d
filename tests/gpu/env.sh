# Sourced by the scripts that run on the GPU machine (Ubuntu 24.04, no network), from the repo
# root, with these git-ignored folders carried along:
#   .bcc    = ../shared/gpu-bcc (bcc 0.26 + LLVM 14 + generic headers, FACTS.md)
#   .wheels = pip download --python-version 3.12 --only-binary=:all: --no-deps -d .wheels pyroute2 setuptools
#             (the image has typer, rich, nvidia-ml-py, prometheus_client, grpcio, pytest,
#             hypothesis, matplotlib: the 64 MiB a call carries hold .bcc and little more)
#   .wheels-k8s (optional, 26 MB) = pip download --python-version 3.12 --only-binary=:all: -d .wheels-k8s \
#             grpcio grpcio-tools kubernetes==37.0.2   (the k8s extra: tests/gpu/test_kube_dra_gpu.py);
#             .bcc + .wheels + it pass the 64 MiB a call carries: carry it in a later call on the
#             same warm machine (ignored folders already there stay)
#   build   = `make` output (stand-in driver, cgcaller, alloc_bench; glibc 2.36 binaries run there)
# The machine's python3 has PyTorch; the package and its deps go to a --target folder on
# PYTHONPATH, so that python3 (and the PyTorch child processes) keep their own packages. No
# folder of the tree is named convgpu (the package's own modules are in core/), so run from the
# repo root python3 finds the installed package and bench/ alike; /tmp/benchpath is for runs
# from elsewhere (bench.e2e runs in /tmp).
OUT=${OUT:-/tmp/convgpu-out}; mkdir -p "$OUT"
source .bcc/bcc-env.sh
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; uname -r; nproc
  python3 -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__)'; } | tee "$OUT/machine.txt"
python3 -m venv /tmp/pipenv >/dev/null && P=/tmp/pipenv/bin/python || P=python3
$P -m pip install -q --no-index --find-links .wheels --target /tmp/pkgs setuptools
PYTHONPATH=/tmp/pkgs $P -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target /tmp/pkgs .
$P -m pip install -q --no-index --no-deps --target /tmp/pkgs .wheels/*.whl   # what the image lacks
[ -d .wheels-k8s ] && $P -m pip install -q --no-index --no-deps --target /tmp/pkgs .wheels-k8s/*.whl   # the k8s extra
mkdir -p /tmp/benchpath && ln -sfn "$PWD/bench" /tmp/benchpath/bench
export PYTHONPATH=/tmp/pkgs:/tmp/benchpath:${PYTHONPATH:-} CONVGPU_BUILD=$PWD/build   # bcc-env.sh put bcc there
