"""What issue 33's fail-closed tests (attacks 2, 3, 5, 6) share: an attacker run as nobody in a
cgroup of its own, a neighbour that allocates meanwhile in another, the enforcer's log, and a
private copy of the stand-in driver: an enforcer probes a library by inode, host-wide, so on the
shared build/standin/libcuda.so.1 it would admit (and, traced by another session's enforcer,
kill) other test sessions' processes, and theirs would admit ours."""
import logging
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from attack import NOBODY, as_nobody
from conftest import cuda_prelude, popen_in, read_until

LOGGER = "convgpu.enforcer.daemon"
# A neighbour in a cgroup of its own: 4 rounds of 64 MiB alloc+free, then holds 64 MiB until told
NEIGHBOUR = """
p = ctypes.c_uint64()
for i in range(4):
    assert cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(64 << 20)) == 0
    assert cu.cuMemFree_v2(p) == 0
assert cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(64 << 20)) == 0
print('ready', flush=True)
sys.stdin.readline()
"""

# Runs argv under a tracer of its own that swallows every SIGSTOP (and passes other signals on)
SWALLOW = r"""
#include <signal.h>
#include <stdio.h>
#include <sys/prctl.h>
#include <sys/ptrace.h>
#include <sys/wait.h>
#include <unistd.h>
int main(int argc, char **argv)
{
    int ready[2];
    pipe(ready);
    prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);
    pid_t tracee = getpid();
    if (fork() == 0) {
        close(ready[0]);
        if (ptrace(PTRACE_SEIZE, tracee, 0, PTRACE_O_TRACECLONE) != 0) { perror("seize"); return 1; }
        write(ready[1], "s", 1);
        int swallowed = 0, st;
        pid_t t;
        while ((t = waitpid(-1, &st, __WALL)) > 0) {
            if (!WIFSTOPPED(st))
                continue;
            int sig = WSTOPSIG(st);
            if (st >> 16 || sig == SIGSTOP) {       /* events, and every stop: dropped */
                swallowed += sig == SIGSTOP && !(st >> 16);
                ptrace(PTRACE_CONT, t, 0, 0);
            } else {
                ptrace(PTRACE_CONT, t, 0, sig);
            }
        }
        fprintf(stderr, "swallowed %d\n", swallowed);
        return 0;
    }
    close(ready[1]);
    char c;
    if (read(ready[0], &c, 1) != 1) return 1;
    execv(argv[1], argv + 1);
    return 1;
}
"""


def build_swallow(d: Path) -> Path:
    """SWALLOW built into d (also for tests/gpu/test_gpu_failclosed.py)."""
    out = Path(d) / "swallow"
    subprocess.run(["gcc", "-O1", "-o", str(out), "-x", "c", "-"], input=SWALLOW, text=True, check=True)
    os.chmod(out, 0o755)
    return out


@pytest.fixture(scope="module")
def own_lib(build) -> Path:
    """A copy of the stand-in driver that only this module's processes load."""
    d = Path(tempfile.mkdtemp(prefix=f"convgpu-failclosed-{os.getpid()}-"))
    os.chmod(d, 0o755)
    os.chown(d, NOBODY, NOBODY)   # a tenant's copy (untrusted.trusted: no self-test, which loads it)
    lib = d / "libcuda.so.1"
    shutil.copy(build / "standin" / "libcuda.so.1", lib)
    os.chmod(lib, 0o755)
    yield lib
    shutil.rmtree(d, ignore_errors=True)


def allocs(n: int, size: int) -> str:
    """A body for python_as_nobody: says 'context', then n cuMemAlloc_v2 of size bytes, each said
    ('alloc i'), then 'done', and waits on stdin."""
    return (f"p = ctypes.c_uint64()\nprint('context', flush=True)\nfor i in range({n}):\n"
            f"    assert cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t({size})) == 0\n"
            "    print('alloc', i + 1, flush=True)\nprint('done', flush=True)\nsys.stdin.readline()\n")


def python_as_nobody(cg, lib, env, body: str, wrap=(), context: bool = True):
    """python3 -c (a context on lib, then body) as nobody inside cgroup cg, under wrap (argv).
    context False: lib loaded and cuInit only (`cu` ready), no context: never placed."""
    script = (cuda_prelude(lib) if context else f"import ctypes,os,sys; cu=ctypes.CDLL('{lib}'); cu.cuInit(0)\n") + body
    return popen_in(cg, *as_nobody(*wrap, "/usr/bin/python3", "-c", script), env=env)


def neighbour_runs(cg, lib, env):
    """The neighbour's four rounds run at once and it holds its 64 MiB: every other container is
    unaffected. Returns its process (waiting on stdin)."""
    p = python_as_nobody(cg, lib, env, NEIGHBOUR)
    assert read_until(p, "ready", timeout=30) == ["ready"]
    return p


def logged(caplog, *words, timeout: float = 10.0) -> list[str]:
    """The enforcer's log lines holding every one of words; waits until one came."""
    deadline = time.monotonic() + timeout
    while True:
        got = [r.getMessage() for r in list(caplog.records)
               if r.name == LOGGER and all(w in r.getMessage() for w in words)]
        if got or time.monotonic() > deadline:
            return got
        time.sleep(0.02)


def quiet_logs(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
