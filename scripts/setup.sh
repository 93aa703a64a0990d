#!/bin/sh
# The developer's set-up: one idempotent set-up of a fresh Debian 12 / Ubuntu 22.04 / 24.04 host
# for the tests and the demo, run as root. Used by both README commands, by .ci/run and by the
# Vagrantfile: there is no second copy. A GPU host that only runs convgpu takes the host install
# instead (scripts/install.sh: no podman, vagrant, tests or containers.conf; docs/OPERATOR.md).
#   - apt packages: bcc (python3-bpfcc; PyPI's "bcc" is an unrelated package), a C compiler,
#     podman + runc for real-container tests and the demo, tmux for the live view's tests
#     (a terminal of a given size), kernel headers;
#   - kernel headers for the running kernel, else the distro's generic headers linked in
#     (uprobe programs use only stable uapi types, so generic headers compile them: FACTS.md);
#   - tracefs mounted; a venv from the *system* python3 with --system-site-packages (bcc's
#     Python part lives in the system dist-packages); the package, editable, with its test extras;
#   - kubectl (Debian's kubernetes-client unless one is installed) for the deployment's tests;
#   - prometheus (with promtool): the tests check the alert rules and scrape the enforcer with it;
#   - the native parts (test stand-in libcuda, callers) built with make.
set -eu
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "setup.sh: run as root (bcc and uprobes need it): sudo $0" >&2; exit 1; }

export DEBIAN_FRONTEND=noninteractive
need=""
for p in python3-bpfcc python3-venv python3-pip gcc make podman runc busybox-static prometheus tmux; do
  dpkg -s "$p" >/dev/null 2>&1 || need="$need $p"
done
# kubectl renders the Kubernetes deployment (deploy/kubernetes) in the tests: Debian's
# kubernetes-client where no kubectl is installed (`kubectl kustomize` is built in); a distro
# without it (Ubuntu 24.04) leaves those tests to say that kubectl is missing
if ! command -v kubectl >/dev/null 2>&1; then
  apt-cache show kubernetes-client >/dev/null 2>&1 || apt-get update -qq   # lists may be absent
  if apt-cache show kubernetes-client >/dev/null 2>&1; then need="$need kubernetes-client"; fi
fi
# vagrant (from the distro, where it has one): the tests validate the Vagrantfile with it
if ! dpkg -s vagrant >/dev/null 2>&1 && apt-cache show vagrant >/dev/null 2>&1; then need="$need vagrant"; fi
. scripts/host.sh   # the kernel headers and tracefs, as the host install does them
hdr="$(host_headers_pkg)"; [ -z "$hdr" ] || need="$need $hdr"
if [ -n "$need" ]; then
  apt-get update -qq
  # shellcheck disable=SC2086
  apt-get install -y -qq --no-install-recommends $need >/dev/null
  # the package starts a Prometheus service on :9090 where systemd runs: the tests start their
  # own (loopback only, a temporary data dir), so the one we installed is stopped and disabled
  case " $need " in *" prometheus "*)
    if command -v systemctl >/dev/null 2>&1; then systemctl disable --now prometheus >/dev/null 2>&1 || true; fi ;;
  esac
fi

host_link_headers
host_tracefs

# podman: no default rlimits (setrlimit is not permitted in some sandboxes; callers pass
# --runtime runc because crun refuses hybrid cgroups). Only written when absent.
if [ ! -e /etc/containers/containers.conf ]; then
  mkdir -p /etc/containers
  printf "[containers]\ndefault_ulimits = []\n" > /etc/containers/containers.conf
fi

if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c 'import bcc' 2>/dev/null; then
  rm -rf .venv
  /usr/bin/python3 -m venv --system-site-packages .venv
fi
# A checkout from before the package's own modules moved to core/ keeps a convgpu/ folder
# holding only the old build's lib*.so and caches: as a namespace package it would shadow the
# real one for anything run from the repo root. It holds nothing tracked any more.
if [ -d convgpu ] && [ -z "$(find convgpu -name '*.py' -print -quit)" ]; then rm -rf convgpu; fi
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test,parallel,bench,plot,k8s]'   # parallel: pytest -n; bench, plot: the plots' CI tests; k8s: the agent's
make -s
