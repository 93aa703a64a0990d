"""What the attacks of issue 24 share: an unprivileged attacker (nobody, or a podman container)
and the files it brings. Each test runs its attack against a real tracer or enforcer on the
stand-in driver (tests/conftest.py)."""
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from conftest import need

NOBODY = 65534
CPUID = 203                 # a character major every x86 kernel here has (cpuid), opened by nobody else
# A file named like the driver that exports what discovery requires, and runs code when loaded:
# the constructor writes who ran it into MARKER (a path on the host).
FORGED = r"""
#include <stdio.h>
#include <unistd.h>
__attribute__((constructor)) static void own(void)
{
    FILE *f = fopen(MARKER, "a");
    if (f) { fprintf(f, "uid=%d euid=%d\n", (int)getuid(), (int)geteuid()); fclose(f); }
}
int cuInit(unsigned flags) { return 3; }
int cuMemAlloc_v2(void **p, unsigned long n) { return 3; }
int cuMemFree_v2(void *p) { return 3; }
int cuDevicePrimaryCtxRetain(void **c, int d) { return 3; }
"""


def as_nobody(*argv) -> list[str]:
    """argv run as nobody, no capabilities left (setpriv execs: the pid is argv's own)."""
    need(shutil.which("setpriv") is not None, "setpriv missing")
    return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--inh-caps=-all",
            "--bounding-set=-all", "--", *map(str, argv)]


@pytest.fixture
def scratch():
    """A directory under /tmp that nobody can reach (pytest's tmp_path is root's alone), with
    `attacker/` owned by nobody, as anything the attacker makes would be."""
    base = Path(tempfile.mkdtemp(prefix=f"convgpu-attack-{os.getpid()}-"))
    os.chmod(base, 0o755)
    (base / "attacker").mkdir()
    os.chown(base / "attacker", NOBODY, NOBODY)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def forge(path, marker) -> None:
    """The forged libcuda.so.1 at path, owned by nobody; its constructor writes to marker.
    Built like the stand-in (tests/standin: push %rbp first), so its probes can attach."""
    need(shutil.which("gcc") is not None, "gcc missing")
    src = f"{path}.c"
    with open(src, "w") as f:
        f.write(FORGED)
    subprocess.run(["gcc", "-shared", "-fPIC", "-O0", "-fno-omit-frame-pointer", "-fcf-protection=none",
                    f'-DMARKER="{marker}"', "-o", str(path), src], check=True, capture_output=True)
    os.unlink(src)
    os.chown(path, NOBODY, NOBODY)


def podman_run(name: str, rootfs, *argv, user: int = NOBODY) -> subprocess.Popen:
    """argv in a podman container (runc, no network) on rootfs, as `user`; stdout piped."""
    need(shutil.which("podman") is not None, "podman not installed")
    return subprocess.Popen(["podman", "--cgroup-manager=cgroupfs", "--runtime", "runc", "run", "--rm",
                             "--network", "none", "--user", str(user), "--name", name, "--rootfs", str(rootfs),
                             *map(str, argv)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def busybox_rootfs(base) -> "os.PathLike":
    busybox = shutil.which("busybox")
    need(busybox is not None, "busybox-static not installed")
    rootfs = base / "rootfs"
    for d in ("bin", "lib", "proc", "sys", "dev", "etc", "tmp"):
        (rootfs / d).mkdir(parents=True, exist_ok=True)
    shutil.copy(busybox, rootfs / "bin" / "busybox")
    os.chmod(rootfs / "tmp", 0o1777)
    return rootfs


def podman_rm(name: str) -> None:
    subprocess.run(["podman", "rm", "-f", "-t", "0", name], capture_output=True, timeout=60)


@pytest.fixture
def gpu_nodes(scratch):
    """nvidiactl, nvidia-uvm and nvidia0 as character devices of the cpuid major, which nobody
    may open (the stand-in opens them at cuInit: CONVGPU_STANDIN_DEVNODES; an enforcer told
    CONVGPU_GPU_MAJORS=CPUID takes them for the GPU's)."""
    need(os.path.exists("/dev/cpu/0/cpuid"), "no cpuid driver: no spare character device to stand in for the GPU")
    d = scratch / "dev"
    d.mkdir()
    for name, minor in (("nvidiactl", 0), ("nvidia-uvm", 0), ("nvidia0", 0)):
        os.mknod(d / name, 0o666 | 0o020000, os.makedev(CPUID, minor))
    os.chmod(d, 0o755)
    return d
