#!/bin/sh
# The host install on a fresh Debian, and the node image, built here with podman (docs/OPERATOR.md,
# "Install, upgrade, uninstall"; docs/KUBERNETES.md, "The image"). Too slow for the suite
# (minutes: a Debian root, its packages, convgpu's from PyPI); run it before a release:
#
#   sh scripts/test-host-install.sh [--image-only | --install-only]
#
# podman here cannot pull an image (no registry is reachable), so the Debian root is made with
# debootstrap from Debian's mirror (cached in /var/tmp/convgpu-debian-rootfs) and imported as
# localhost/convgpu-debian:bookworm. Then, in a privileged container of it (a host of its own:
# its own /usr, /etc, /lib/modules, apt), scripts/install.sh runs as on a new host and
# `convgpu doctor` must end with its one-line verdict; then --uninstall --purge must leave no
# convgpu file. Last, deploy/Containerfile builds the node image on that same base
# (--build-arg BASE=...; its default is ubuntu:24.04, which a registry serves) and the image's
# own check (its last RUN imports bcc, gRPC and the kubelet's protocols) passes.
set -eu
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "test-host-install.sh: run as root" >&2; exit 1; }
rootfs=/var/tmp/convgpu-debian-rootfs
base=localhost/convgpu-debian:bookworm
what="${1:-all}"
runtime=""
# crun refuses hybrid cgroup hosts (this one): runc where it is installed
command -v runc >/dev/null 2>&1 && runtime="--runtime runc"
# behind a TLS-inspecting proxy pip is given its CA (PIP_CERT): the containers get the same file
ca=""
if [ -n "${PIP_CERT:-}" ] && [ -f "$PIP_CERT" ]; then ca="-v $PIP_CERT:/run/host-ca.crt:ro"; fi

if ! podman image exists "$base"; then
  if [ ! -x "$rootfs/bin/sh" ]; then
    command -v debootstrap >/dev/null 2>&1 || apt-get install -y -qq debootstrap >/dev/null
    debootstrap --variant=minbase bookworm "$rootfs.tmp" http://deb.debian.org/debian
    mv "$rootfs.tmp" "$rootfs"
  fi
  tar -C "$rootfs" -c . | podman import - "$base" >/dev/null
fi

if [ "$what" != --image-only ]; then
  # shellcheck disable=SC2086
  out="$(podman run --rm $runtime $ca --privileged --network host -v "$PWD:/src:ro" "$base" sh -c '
      set -e
      [ ! -e /run/host-ca.crt ] || export PIP_CERT=/run/host-ca.crt
      sh /src/scripts/install.sh >/tmp/install.log 2>&1 || { cat /tmp/install.log; exit 1; }
      command -v convgpu
      convgpu doctor || true
      echo "--- uninstall"
      sh /src/scripts/install.sh --uninstall --purge
      ls -d /opt/convgpu /usr/local/bin/convgpu /etc/convgpu /etc/systemd/system/convgpu-enforce.service \
        /var/lib/convgpu 2>/dev/null || echo "nothing of convgpu left"' 2>&1)" || true
  echo "$out"
  verdict="$(echo "$out" | sed -n '/--- uninstall/q;p' | grep -E '^(convgpu: )?verdict: ' || true)"
  [ "$(echo "$out" | sed -n 1p)" = /usr/local/bin/convgpu ] || { echo "FAIL: convgpu is not on PATH" >&2; exit 1; }
  [ -n "$verdict" ] || { echo "FAIL: doctor gave no verdict" >&2; exit 1; }
  echo "$out" | grep -qx "nothing of convgpu left" || { echo "FAIL: the uninstall left files" >&2; exit 1; }
  echo "ok: host install on a fresh Debian 12; doctor's $verdict"
fi

if [ "$what" != --install-only ]; then
  # shellcheck disable=SC2086
  podman build $runtime $ca --network host --build-arg "BASE=$base" ${ca:+--build-arg PIP_CERT=/run/host-ca.crt} -f deploy/Containerfile -t convgpu:test-build . >/tmp/convgpu-image.log 2>&1 \
    || { tail -30 /tmp/convgpu-image.log; echo "FAIL: deploy/Containerfile did not build" >&2; exit 1; }
  # shellcheck disable=SC2086
  podman run --rm $runtime convgpu:test-build --version
  podman rmi convgpu:test-build >/dev/null
  echo "ok: deploy/Containerfile builds on $base (and on its default base wherever a registry is reachable)"
fi
