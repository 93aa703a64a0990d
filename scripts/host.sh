# What the developer's set-up (scripts/setup.sh) and the host install (scripts/install.sh) both
# do to a Debian 12 / Ubuntu 22.04 / 24.04 host, written once. Sourced (POSIX sh), as root.
#   host_headers_pkg: the kernel-headers package to install, or nothing where bcc has them;
#   host_link_headers: where none match the running kernel, the distro's generic headers linked
#     in (uprobe programs use only stable uapi types, so generic headers compile them; `convgpu
#     doctor` says that they are another kernel's);
#   host_tracefs: tracefs mounted (bcc attaches uprobes through it).

host_kr="$(uname -r)"

# bcc needs the full header tree: kconfig.h lives in the arch-independent part (-common), so a
# build link alone (or a source link to the arch part) is not enough.
host_headers_ok() {
  [ -e "/lib/modules/$host_kr/build/include/linux/kconfig.h" ] || [ -e "/lib/modules/$host_kr/source/include/linux/kconfig.h" ]
}

host_headers_pkg() {
  host_headers_ok && return 0
  # Exact headers when the distro has them, else the generic flavour (linked in afterwards).
  if apt-cache show "linux-headers-$host_kr" >/dev/null 2>&1; then hdr="linux-headers-$host_kr"
  elif grep -qi ubuntu /etc/os-release; then hdr="linux-headers-generic"
  else hdr="linux-headers-amd64"; fi
  dpkg -s "$hdr" >/dev/null 2>&1 || echo "$hdr"
}

host_link_headers() {
  host_headers_ok && return 0
  b="$(ls -d /usr/src/linux-headers-*-amd64 /usr/src/linux-headers-*-generic 2>/dev/null | sort -V | tail -n1)"
  [ -n "$b" ] || { echo "convgpu: no kernel headers under /usr/src; install linux-headers-$host_kr" >&2; return 1; }
  # Debian splits the tree (-amd64 + -common); Ubuntu's -generic is whole. (Not `ls -d A B`:
  # ls sorts its output, and -amd64 sorts before -common.)
  c="$b"; [ -d "${b%-*}-common" ] && c="${b%-*}-common"
  mkdir -p "/lib/modules/$host_kr"
  ln -sfn "$b" "/lib/modules/$host_kr/build"
  ln -sfn "$c" "/lib/modules/$host_kr/source"
  echo "convgpu: no headers of kernel $host_kr in the distro: $(basename "$b") linked in (enough for convgpu's probes; \`convgpu doctor\` says so)" >&2
}

host_tracefs() {
  mountpoint -q /sys/kernel/tracing || mount -t tracefs tracefs /sys/kernel/tracing 2>/dev/null || true
}
