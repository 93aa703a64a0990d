"""Issue 24, row 1: a forged libcuda.so.1 (the three symbols discovery requires, and an ELF
constructor) opened read-only by an unprivileged process, on the host as nobody or inside a
podman container. Before: discovery attached it, then the self-test child loaded it with
ctypes as root, and its constructor wrote `uid=0 euid=0`. Now it is read, never loaded: its
code never runs in convgpu (no marker at all), and it is still probed (verified by reading)."""
import os
import subprocess
import sys
import time

import pytest

from attack import as_nobody, busybox_rootfs, forge, podman_rm, podman_run, scratch  # noqa: F401
from conftest import Enforcing, lines_until, stop_all

pytestmark = [pytest.mark.system, pytest.mark.exclusive]   # discovery reaches every driver file on the host

OPEN = "import os,sys; fd=os.open(sys.argv[1], os.O_RDONLY); print('opened', flush=True); sys.stdin.readline()"


def _attack(enf, opener, lib, marker, pid=None):
    """The opener holds lib open; the enforcer has probed it (its log says so), the opener
    (host pid `pid()`, else its own) was stopped at its one open exactly once and let go, and
    no code of the library ran, as anyone."""
    out: list = []
    lines_until(opener.stdout, lambda line: line == "opened", out, 60, "attacker")
    line = lines_until(enf.p.stderr, lambda x: "probes attached to" in x and lib in x, enf.log, 30, "enforcer log")
    time.sleep(1.0)                  # a self-test child would have run before the opener was let go
    assert not os.path.exists(marker), open(marker).read()
    assert "verified by reading it" in line, line
    st = enf.ctl(cmd="status")["status"]
    # (other processes of this host may be held for files of their own: only ours counts)
    opener_pid = pid() if pid else opener.pid
    assert st["discovery"]["on"] and st["discovery"]["recent"].count(opener_pid) == 1, (opener_pid, st["discovery"])
    assert [u for u in st["unprobed"] if lib in u["library"]] == []


def test_row01_forged_libcuda_as_nobody_is_read_never_run(root, build, scratch):
    marker = scratch / "marker"
    os.chmod(scratch, 0o1777)        # the constructor could write here as anyone, root or nobody
    lib = scratch / "attacker" / "libcuda.so.1"
    forge(lib, marker)
    enf = Enforcing(build, "--gpu-memory", "1GiB", "--discover", start_timeout=120)
    opener = None
    try:
        opener = subprocess.Popen(as_nobody(sys.executable, "-c", OPEN, lib), stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/")
        _attack(enf, opener, str(lib), marker)
    finally:
        stop_all([opener], enf)


def test_row01_forged_libcuda_in_a_container_is_read_never_run(root, build, scratch):
    """The same library inside a podman container's own filesystem, opened by its uid 65534."""
    marker = scratch / "marker"
    os.chmod(scratch, 0o1777)
    rootfs = busybox_rootfs(scratch)
    (rootfs / "opt").mkdir()
    forge(rootfs / "opt" / "libcuda.so.1", marker)
    name = f"convgpu-row01-{os.getpid()}"
    enf = Enforcing(build, "--gpu-memory", "1GiB", "--discover", start_timeout=120)
    c = None
    try:
        c = podman_run(name, rootfs, "/bin/busybox", "sh", "-c", "exec 3</opt/libcuda.so.1; echo opened; sleep 60")
        # the shell is the container's first process: it opened the file itself (fd 3)
        _attack(enf, c, "/opt/libcuda.so.1", marker, pid=lambda: int(subprocess.run(
            ["podman", "inspect", "--format", "{{.State.Pid}}", name], capture_output=True, text=True,
            timeout=60).stdout))
    finally:
        podman_rm(name)
        stop_all([c], enf)
