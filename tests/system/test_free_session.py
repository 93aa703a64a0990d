"""Issue 32: a free is settled at its entry, and its return never trapped, where that cannot
matter (bpf free_session: a uprobe session, Linux >= 6.13); at its return where it can: while
someone waits for memory, or while its container stands near its limit (less than an eighth of
its assignment, or twice the block, to spare). Counted by the kernel (run-time statistics on):
the session program runs once per free at the entry alone, twice with the return. The books
stay exact either way, and CONVGPU_UPROBE_SESSIONS=off gives the entry and return programs
of kernels without sessions. Each test probes a private copy of the stand-in, so nothing else
on the host runs its programs."""
import ctypes as ct
import select
import shutil
import subprocess
import sys

import pytest

from bench import bpf_stats
from conftest import MiB, cuda_prelude, inprocess_enforcer, popen_in, until

pytestmark = pytest.mark.system
PAIRS = 300
CHILD = """
cu.cuMemAlloc_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t]; cu.cuMemFree_v2.argtypes = [ctypes.c_uint64]
p, big = ctypes.c_uint64(), ctypes.c_uint64()
print('up', flush=True)
for line in sys.stdin:
    w = line.split()
    if w[0] == 'hold':
        assert cu.cuMemAlloc_v2(ctypes.byref(big), int(w[1])) == 0
    elif w[0] == 'drop':
        assert cu.cuMemFree_v2(big.value) == 0
    else:
        for i in range(int(w[1])):
            assert cu.cuMemAlloc_v2(ctypes.byref(p), 4096) == 0 and cu.cuMemFree_v2(p.value) == 0
    print('done', flush=True)
"""


@pytest.fixture
def lib(build, tmp_path):
    d = tmp_path / "standin"
    shutil.copytree(build / "standin", d, symlinks=True)
    return d / "libcuda.so.1"


class Child:
    def __init__(self, lib, caller_env, cg=None, step=lambda: None):
        argv = [sys.executable, "-c", cuda_prelude(lib) + CHILD]
        self.p = popen_in(cg, *argv, env=caller_env) if cg else subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=caller_env)
        self.step = step
        self._wait("up")

    def _wait(self, word):
        line = ""

        def got():
            nonlocal line
            self.step()
            if select.select([self.p.stdout], [], [], 0.01)[0]:
                line = self.p.stdout.readline().strip()
            return bool(line) or self.p.poll() is not None
        until(got, 30, f"the child to say {word}")
        assert line == word, (line, self.p.poll())

    def do(self, what):
        self.p.stdin.write(what + "\n")
        self.p.stdin.flush()
        self._wait("done")

    def close(self):
        self.p.kill()
        self.p.wait()


def runs(b, *names) -> list[int]:
    return [bpf_stats.runs_of(b.funcs[n.encode()].fd) if n.encode() in b.funcs else 0 for n in names]


def attached_as_session(t, symbol) -> bool:
    return next(a.session for lp in t.attached for a in lp.probes if a.probe.symbol == symbol)


@pytest.mark.parametrize("sessions", ["on", "off"])
def test_tracer_frees(root, lib, caller_env, monkeypatch, sessions):
    """on: one run per free, at its entry (no return trap); off (or a kernel before 6.13): the
    entry and the return program, once each per free. The books are exact either way."""
    from convgpu.probes.tracer import Tracer
    monkeypatch.setenv("CONVGPU_UPROBE_SESSIONS", sessions)
    t = Tracer(libraries=(str(lib),), discover=False, selftest=False).start()
    c = None
    try:
        assert attached_as_session(t, "cuMemFree_v2") == (sessions == "on")
        c = Child(lib, caller_env)
        names = ("sess_cuMemFree_v2", "enter_cuMemFree_v2", "exit_free")
        with bpf_stats.enabled():
            before = runs(t.b, *names)
            c.do(f"pairs {PAIRS}")
            after = runs(t.b, *names)
        assert [a - b for a, b in zip(after, before)] == ([PAIRS, 0, 0] if sessions == "on" else [0, PAIRS, PAIRS])
        list(t.poll())
        u = {x.dev: x for x in t.usage() if x.pid == c.p.pid}[0]
        assert (u.n_alloc, u.n_free, u.live) == (PAIRS, PAIRS, 0)
    finally:
        if c:
            c.close()
        t.close()


def test_enforced_frees_settle_at_return_only_near_the_limit(root, lib, caller_env, cgroups):
    """64 MiB limit, alone on the card (assigned = limit): 4 KiB pairs far from it are settled
    at their entry; holding 60 MiB (4 MiB left, under the eighth) at their return; a 4 MiB
    block (above the 2 MiB that may settle at entry) at its return however far from the limit;
    the container's books are exact after each phase, down to the byte."""
    enf = inprocess_enforcer(lib, "session", 64 * MiB).start()
    c = None
    try:
        assert attached_as_session(enf.tracer, "cuMemFree_v2")
        c = Child(lib, caller_env, cgroups("session"), step=enf.step)
        b = enf.tracer.b
        key = b[b"members"][ct.c_uint32(c.p.pid)].value & ~(1 << 63)

        def used():
            return next(v.used for k, v in b[b"cgstate"].items() if k.container == key and k.dev == 0)

        def phase(what) -> int:
            with bpf_stats.enabled():
                n0, = runs(b, "sess_cuMemFree_v2")
                c.do(what)
                n1, = runs(b, "sess_cuMemFree_v2")
            return n1 - n0
        assert phase(f"pairs {PAIRS}") == PAIRS        # far from the limit: entry only
        assert used() == 0
        assert phase(f"hold {60 * MiB}") == 0
        assert used() == 60 * MiB
        assert phase(f"pairs {PAIRS}") == 2 * PAIRS    # near it: entry and return
        assert used() == 60 * MiB
        assert phase("drop") == 2                      # the 60 MiB free itself leaves 0 of 4 to spare
        assert used() == 0
        assert phase(f"pairs {PAIRS}") == PAIRS        # room again
        assert used() == 0
        assert phase(f"hold {4 * MiB}") == 0           # a block above 2 MiB, far from the limit:
        assert used() == 4 * MiB
        assert phase("drop") == 2                      # settled at its return all the same
        assert used() == 0
    finally:
        if c:
            c.close()
        enf.close()
