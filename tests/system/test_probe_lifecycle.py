"""Probes on a driver copy of the test's own, without discovery (so not `exclusive`: moved out
of test_discovery.py, whose whole module runs alone): a closed tracer leaves no breakpoint in a
running process, as links or as perf events; links share a driver with another tool's perf
probes."""
import subprocess
import sys

import pytest

from conftest import MiB, cuda_prelude, usage_of

pytestmark = pytest.mark.system
MAPPER = "import ctypes, sys; ctypes.CDLL(sys.argv[1]); print('mapped', flush=True); sys.stdin.readline()"


@pytest.mark.parametrize("want", ["on", "off"])
def test_a_closed_tracer_leaves_no_breakpoint_in_a_running_process(root, private_copy, caller_env, monkeypatch, want):
    """A process holds a fresh driver copy; a tracer probes it (every entry point of the table
    the copy exports, and the enforcer's recheck sites, hold an int3 in that process) and closes in the background, as `trace`
    does at Ctrl-C. As BPF links (probes/links.py) every breakpoint is gone when close()
    returns; as perf events (CONVGPU_UPROBE_LINKS=off, or a kernel before 6.6) a child removes
    them one by one, and they are gone once it ends."""
    from bench.e2e_modes import Hooks
    from convgpu.probes import links
    from convgpu.probes.table import ADMITTED, CUDA, PROBES
    from convgpu.probes.tracer import Tracer
    monkeypatch.setenv("CONVGPU_UPROBE_LINKS", want)
    mode = "links" if want == "on" and links.supported()[0] else "perf events"
    holder = subprocess.Popen([sys.executable, "-c", MAPPER, str(private_copy)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=caller_env)
    t = None
    try:
        assert holder.stdout.readline().strip() == "mapped"
        hooks = Hooks(holder.pid)
        t = Tracer(libraries=(str(private_copy),), discover=False, selftest=False, recheck=True).start()
        assert links.kind(t.b) == mode
        entries = {f"libcuda.so.1:{p.symbol}" for p in PROBES if p.library == CUDA}
        rechecks = {f"libcuda.so.1:{s}+4" for s in ADMITTED}   # the enforcer's (probes/prologue.py)
        assert hooks.hooked() == entries | rechecks == set(hooks.addrs)
        child, t = t.close(background=True), None
        if mode == "perf events":
            assert child.wait(timeout=300) == 0
        assert hooks.hooked() == set()
    finally:
        if t is not None:
            t.close()
        holder.kill()
        holder.wait()


def test_links_share_a_driver_with_another_tools_perf_probe(root, private_copy, caller_env):
    """Perf-event uprobes of another tool (bcc's kind, as convgpu before links) sit on
    cuMemFree_v2 and on cuMemAlloc_v2, the first probe attached: the kernel refuses a link
    there (ref_ctr_offset mismatch), so those probes become perf events of their own and the
    rest stay links; every call is still counted once."""
    import bcc
    from convgpu.probes import links
    from convgpu.probes.tracer import Tracer
    other = bcc.BPF(text=b"int hit(struct pt_regs *ctx) { return 0; }")
    other.attach_uprobe(name=str(private_copy).encode(), sym=b"cuMemFree_v2", fn_name=b"hit")
    other.attach_uprobe(name=str(private_copy).encode(), sym=b"cuMemAlloc_v2", fn_name=b"hit")   # the first one
    t = None
    try:
        t = Tracer(libraries=(str(private_copy),), discover=False, selftest=False).start()
        assert t.failed == []
        if links.supported()[0]:   # perf events: the entries and returns of cuMemFree_v2 and cuMemAlloc_v2
            assert links.kind(t.b) == "links" and len(t.b.uprobe_fds) == 4 and len(links.fds(t.b)) > 40
        else:                      # before Linux 6.6 every probe is one, beside the other tool's
            assert links.kind(t.b) == "perf events" and links.fds(t.b) == []
        code = cuda_prelude(private_copy) + (
            "p = [ctypes.c_uint64() for _ in range(3)]\n"
            "assert all(cu.cuMemAlloc_v2(ctypes.byref(x), ctypes.c_size_t(2 << 20)) == 0 for x in p)\n"
            "assert cu.cuMemFree_v2(p[0]) == 0\n"
            "print('done', flush=True); sys.stdin.readline()\n")
        holder = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True, env=caller_env)
        try:
            assert holder.stdout.readline().strip() == "done"
            u = usage_of(t, holder.pid)[0]
            assert (u.live, u.n_alloc, u.n_free, u.contexts) == (2 * 2 * MiB, 3, 1, 1)
        finally:
            holder.kill()
            holder.wait()
    finally:
        if t is not None:
            t.close()
        other.cleanup()
