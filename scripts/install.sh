#!/bin/sh
# The host install: what `convgpu enforce` (the systemd unit) and `convgpu trace` need on a GPU
# host, and nothing of the developer's set-up (scripts/setup.sh: podman, vagrant, the tests'
# extras, a containers.conf, the stand-in driver). docs/OPERATOR.md, "Install, upgrade,
# uninstall", says what each step leaves where.
#
#   sh scripts/install.sh [--enable]          install, or upgrade in place (run from the new checkout)
#   sh scripts/install.sh --uninstall [--purge]
#
# Installs: apt packages python3-bpfcc (bcc), python3-venv, gcc and libc6-dev (to build the
# preload shim), the kernel headers bcc compiles with (the running kernel's, else the generic
# ones linked in); a venv in /opt/convgpu (--system-site-packages: bcc is the distro's) with
# convgpu from this checkout, not editable (the checkout may go); /usr/local/bin/convgpu (on
# PATH) and the docs in /opt/convgpu/share/doc/convgpu; the unit
# /etc/systemd/system/convgpu-enforce.service, which runs that command;
# /etc/convgpu/config.toml from contrib/config.example.toml where there is none (never
# replaced). --enable starts the unit (and restarts it on an upgrade).
# --uninstall removes the unit, the command and /opt/convgpu; --purge also /etc/convgpu, the
# state (/var/lib/convgpu), the BPF cache (/var/cache/convgpu), /run/convgpu, BPF pins left
# under /sys/fs/bpf (convgpu-*) and the empty cgroups `convgpu run` left (convgpu.run).
# --root DIR puts every path under DIR and touches neither apt nor systemd (tests/system/
# test_packaging.py installs and uninstalls into a scratch root); --no-apt skips apt.
set -eu
src="$(cd "$(dirname "$0")/.." && pwd)"
root="" apt=1 enable=0 uninstall=0 purge=0
while [ $# -gt 0 ]; do
  case "$1" in
    --root) root="${2%/}"; apt=0; shift ;;
    --no-apt) apt=0 ;;
    --enable) enable=1 ;;
    --uninstall) uninstall=1 ;;
    --purge) purge=1 ;;
    *) echo "install.sh: unknown option $1; see the head of $0" >&2; exit 1 ;;
  esac
  shift
done
[ "$(id -u)" = 0 ] || { echo "install.sh: run as root: sudo sh $0" >&2; exit 1; }
prefix="$root/opt/convgpu"
bin="$root/usr/local/bin/convgpu"
unit="$root/etc/systemd/system/convgpu-enforce.service"
systemd=0
[ -z "$root" ] && command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ] && systemd=1

say() { echo "convgpu install: $*"; }

if [ "$uninstall" = 1 ]; then
  if [ "$systemd" = 1 ] && [ -e "$unit" ]; then
    systemctl disable --now convgpu-enforce.service >/dev/null 2>&1 || true
  fi
  # an enforcer outside the unit still holds the host's lock (enforcer/hostlock.py): its state
  # and pins are its own, so they stay
  if [ -z "$root" ] && [ -x "$prefix/bin/convgpu" ] && "$prefix/bin/python" -c \
      'import sys; from convgpu.enforcer.hostlock import running; r = running(); sys.exit(0 if r else 1)' 2>/dev/null; then
    echo "install.sh: an enforcer still runs (see /run/convgpu/enforcer.lock): stop it first" >&2
    exit 1
  fi
  rm -f "$unit"
  [ "$systemd" = 1 ] && systemctl daemon-reload
  if [ -L "$bin" ]; then rm -f "$bin"; fi
  rm -rf "$prefix"
  say "removed the unit, $bin and $prefix"
  if [ "$purge" = 1 ]; then
    rm -rf "$root/etc/convgpu" "$root/var/lib/convgpu" "$root/var/cache/convgpu" "$root/run/convgpu"
    for pin in "$root"/sys/fs/bpf/convgpu-*; do [ -e "$pin" ] && rm -rf "$pin"; done
    left=""
    for top in "$root"/sys/fs/cgroup "$root"/sys/fs/cgroup/unified "$root"/sys/fs/cgroup/freezer; do
      d="$top/convgpu.run"
      [ -d "$d" ] || continue
      for job in "$d"/*/; do   # a job's cgroup goes when its last process has; one still running stays
        [ -d "$job" ] || continue
        rmdir "$job" 2>/dev/null || left="$left ${job%/}"
      done
      rmdir "$d" 2>/dev/null || left="$left $d"
    done
    say "purged /etc/convgpu, /var/lib/convgpu, /var/cache/convgpu, /run/convgpu, BPF pins and convgpu.run cgroups"
    [ -z "$left" ] || say "left (processes still in them):$left"
  fi
  exit 0
fi

if [ "$apt" = 1 ]; then
  export DEBIAN_FRONTEND=noninteractive
  . "$src/scripts/host.sh"
  need=""
  for p in python3-bpfcc python3-venv gcc libc6-dev; do
    dpkg -s "$p" >/dev/null 2>&1 || need="$need $p"
  done
  apt-cache show python3-bpfcc >/dev/null 2>&1 || apt-get update -qq   # lists may be absent
  hdr="$(host_headers_pkg)"; [ -z "$hdr" ] || need="$need $hdr"
  if [ -n "$need" ]; then
    apt-get update -qq
    # shellcheck disable=SC2086
    apt-get install -y -qq --no-install-recommends $need >/dev/null
    say "installed$need"
  fi
  host_link_headers || true   # `convgpu doctor` says what is missing
  host_tracefs
fi

# the venv: made once; an upgrade installs the new checkout over the old in it
if [ ! -x "$prefix/bin/python" ] || ! "$prefix/bin/python" -c 'import sys' 2>/dev/null; then
  mkdir -p "$(dirname "$prefix")"
  /usr/bin/python3 -m venv --system-site-packages "$prefix"
fi
before="$("$prefix/bin/python" -c 'import convgpu; print(convgpu.__version__)' 2>/dev/null || echo none)"
# built from a copy: the checkout may be read-only, and its build/ holds the tests' stand-in
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
mkdir "$tmp/src"
tar -C "$src" --exclude=./.venv --exclude=./build --exclude=./.git --exclude='*.egg-info' -cf - . | tar -C "$tmp/src" -xf -
pip="$prefix/bin/python -m pip -q --disable-pip-version-check"
$pip wheel --no-deps -w "$tmp/wheel" "$tmp/src" >/dev/null   # built once (the shim is compiled here)
$pip install "$tmp"/wheel/convgpu-*.whl
# the same version number from a newer checkout: reinstall the package itself (its dependencies stay)
$pip install --force-reinstall --no-deps "$tmp"/wheel/convgpu-*.whl
now="$("$prefix/bin/python" -c 'import convgpu; print(convgpu.__version__)')"
mkdir -p "$(dirname "$bin")" "$prefix/share/doc/convgpu"
ln -sfn "$prefix/bin/convgpu" "$bin"
cp "$src"/docs/*.md "$src/README.md" "$prefix/share/doc/convgpu/"   # the unit's Documentation=

mkdir -p "$(dirname "$unit")" "$root/etc/convgpu"
sed "s|^ExecStart=/usr/local/bin/convgpu |ExecStart=$bin |" "$src/contrib/systemd/convgpu-enforce.service" > "$unit.tmp"
mv "$unit.tmp" "$unit"
if [ ! -e "$root/etc/convgpu/config.toml" ]; then
  cp "$src/contrib/config.example.toml" "$root/etc/convgpu/config.toml"
  say "wrote $root/etc/convgpu/config.toml (from contrib/config.example.toml): set gpu_memory or leave NVML's"
fi
if [ "$systemd" = 1 ]; then
  systemctl daemon-reload
  if [ "$enable" = 1 ]; then
    systemctl enable convgpu-enforce.service >/dev/null 2>&1
    systemctl restart convgpu-enforce.service   # an upgrade: the new code; the state dir carries over
  fi
fi
say "convgpu $now installed in $prefix (was: $before); \`convgpu\` is $bin"
say "next: \`convgpu doctor\`; then \`systemctl enable --now convgpu-enforce\` (or run this with --enable)"
