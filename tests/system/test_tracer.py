"""Real uprobes on the stand-in libcuda.so.1: every API family, exact counts and bytes per
process, failed calls, threads, and exits. Root and the real kernel; no GPU."""
import ctypes
import os
import signal
import subprocess
import sys

import pytest

from conftest import MiB, cuda_prelude, drain, events_of, footprint, usage_of

pytestmark = pytest.mark.system


def test_event_layout_matches_the_loaded_program(tracer):
    from convgpu.probes.events import FORMAT, layout
    leaf = tracer.b[b"layout_event"].Leaf
    assert ctypes.sizeof(leaf) == FORMAT.size == 80
    theirs = [(name, getattr(leaf, name).offset, getattr(leaf, name).size) for name, *_ in leaf._fields_]
    assert theirs == layout()


def test_every_probe_attached_fired_and_is_cheap(tracer):
    driver = next(lp for lp in tracer.attached if lp.library.kind == "cuda")
    assert all(a.ok for a in driver.probes), [(a.probe.symbol, a.reason) for a in driver.probes if not a.ok]
    assert [a.probe.symbol for a in driver.probes if a.fired is not True] == []
    # the stand-in is built like the driver: every entry starts with push %rbp (emulated)
    assert {a.insn for a in driver.probes} == {"emulated"}
    rt = next(lp for lp in tracer.attached if lp.library.kind == "cudart")
    assert all(a.ok for a in rt.probes) and len(rt.probes) == 6


def test_alloc_exact_bytes_and_counts(tracer, run_caller):
    c = run_caller("alloc", "-n", 23, "-s", 3 * MiB)
    assert c.allocated == (23, 23 * 3 * MiB)
    u = usage_of(tracer, c.pid)
    assert list(u) == [0]
    # 3 MiB requests take two 2 MiB device pages each, as on the real driver
    assert (u[0].live, u[0].n_alloc, u[0].n_free, u[0].contexts, u[0].n_failed) == (23 * 4 * MiB, 23, 0, 1, 0)
    assert u[0].peak == 23 * 4 * MiB
    assert c.release() == 0
    evs = events_of(tracer, c.pid, wait_for="exit")
    allocs = [e for e in evs if e.op == "alloc"]
    frees = [e for e in evs if e.op == "free"]
    assert len(allocs) == 23 and {e.size for e in allocs} == {4 * MiB} and {e.api for e in allocs} == {"cuMemAlloc_v2"}
    assert len(frees) == 23 and sum(e.size for e in frees) == 23 * 4 * MiB and frees[-1].live == 0
    exit_ev = [e for e in evs if e.op == "exit"]
    assert len(exit_ev) == 1 and exit_ev[0].size == 0     # nothing left at exit
    assert usage_of(tracer, c.pid) == {}


@pytest.mark.parametrize("family,n,size,api", [
    ("pitch", 5, 1000, "cuMemAllocPitch_v2"),
    ("managed", 4, 5 * MiB, "cuMemAllocManaged"),
])
def test_other_allocators_exact(tracer, run_caller, family, n, size, api):
    c = run_caller(family, "-n", n, "-s", size)
    count, total = c.allocated
    assert count == n
    total = n * footprint(total // n)
    u = usage_of(tracer, c.pid)[0]
    assert (u.live, u.n_alloc) == (total, n)
    assert c.release() == 0
    evs = events_of(tracer, c.pid, wait_for="exit")
    assert {e.api for e in evs if e.op == "alloc"} == {api}
    assert sum(e.size for e in evs if e.op == "free") == total


def test_async_and_pools(tracer, run_caller):
    c = run_caller("async", "-n", 6, "-s", 2 * MiB)
    assert c.allocated == (12, 12 * 2 * MiB)
    u = usage_of(tracer, c.pid)[0]
    assert (u.live, u.n_alloc) == (12 * 2 * MiB, 12)
    assert c.release() == 0
    evs = events_of(tracer, c.pid, wait_for="exit")
    apis = [e.api for e in evs if e.op == "alloc"]
    assert apis.count("cuMemAllocAsync") == 6 and apis.count("cuMemAllocFromPoolAsync") == 6
    assert [e.api for e in evs if e.op == "free"] == ["cuMemFreeAsync"] * 12


def test_vmm_bytes_live_until_released_and_unmapped(tracer, run_caller):
    c = run_caller("vmm", "-n", 4, "-s", 2 * MiB)
    assert c.allocated == (4, 8 * MiB)
    u = usage_of(tracer, c.pid)[0]
    assert (u.live, u.n_alloc) == (8 * MiB, 4)
    assert c.release() == 0
    evs = events_of(tracer, c.pid, wait_for="exit")
    assert [e.op for e in evs if e.api == "cuMemMap"] == ["map"] * 4
    deferred = [e for e in evs if e.deferred]
    assert len(deferred) == 2 and {e.api for e in deferred} == {"cuMemRelease"}   # odd i: release first
    frees = [e for e in evs if e.op == "free" and e.size]
    # even i: freed by cuMemRelease after unmap; odd i: by the last cuMemUnmap
    assert sorted(e.api for e in frees) == ["cuMemRelease", "cuMemRelease", "cuMemUnmap", "cuMemUnmap"]
    assert sum(e.size for e in frees) == 8 * MiB and frees[-1].live == 0
    assert [e.op for e in evs if e.api in ("cuMemAddressReserve", "cuMemAddressFree")] == ["reserve", "unreserve"]


def test_arrays_estimated_from_descriptors(tracer, run_caller):
    c = run_caller("array", "-n", 2)
    count, total = c.allocated
    u = usage_of(tracer, c.pid)[0]
    assert (u.live, u.n_alloc) == (total, count)
    assert c.release() == 0
    evs = events_of(tracer, c.pid, wait_for="exit")
    allocs = [e for e in evs if e.op == "alloc"]
    assert all(e.estimate for e in allocs) and sum(e.size for e in allocs) == total
    assert sum(e.size for e in evs if e.op == "free") == total


def test_contexts_counted_and_device_followed(tracer, run_caller):
    c = run_caller("ctx", "-s", 4 * MiB)
    u = usage_of(tracer, c.pid)[0]
    assert (u.contexts, u.live) == (2, 4 * MiB)     # primary + created
    assert c.release() == 0
    evs = events_of(tracer, c.pid, wait_for="exit")
    assert [e.op for e in evs if e.op.startswith("ctx")] == ["ctx_create", "ctx_create", "ctx_destroy"]


def test_failed_allocation_changes_nothing(tracer, run_caller):
    c = run_caller("fail", "-s", 2 * MiB, env={"CONVGPU_STANDIN_CAPACITY": str(1 * MiB)})
    u = usage_of(tracer, c.pid)[0]
    assert (u.live, u.n_alloc, u.n_failed) == (0, 0, 1)
    assert c.release() == 0
    failed = [e for e in events_of(tracer, c.pid, wait_for="exit") if e.op == "failed"]
    assert len(failed) == 1 and failed[0].result == 2 and failed[0].size == 2 * MiB


def test_runtime_calls_name_the_driver_calls_counted_once(tracer, run_caller):
    c = run_caller("runtime", "-n", 3, "-s", 1 * MiB)
    count, total = c.allocated
    u = usage_of(tracer, c.pid)[0]
    assert (u.live, u.n_alloc) == (total, count)     # driver-level only: not doubled
    assert c.release() == 0
    evs = events_of(tracer, c.pid, wait_for="exit")
    allocs = [e for e in evs if e.op == "alloc"]
    assert [e.rt_api for e in allocs].count("cudaMalloc") == 3
    assert {e.rt_api for e in allocs} == {"cudaMalloc", "cudaMallocPitch", "cudaMalloc3D", "cudaMallocManaged"}
    assert {e.rt_api for e in evs if e.op == "free"} == {"cudaFree"}
    assert any(e.api == "cudaMemGetInfo" and e.op == "meminfo" for e in evs)


def test_64_threads_allocating_concurrently(tracer, run_caller):
    c = run_caller("alloc", "-n", 10, "-s", 1 * MiB, "-t", 64)
    assert c.allocated == (640, 640 * MiB)
    u = usage_of(tracer, c.pid)[0]
    assert (u.live, u.n_alloc, u.peak) == (640 * MiB, 640, 640 * MiB)
    assert c.release() == 0
    evs = events_of(tracer, c.pid, wait_for="exit")
    assert len([e for e in evs if e.op == "free"]) == 640
    assert len({e.tid for e in evs if e.op == "alloc"}) == 64


def test_sigkill_releases_everything(tracer, run_caller):
    c = run_caller("alloc", "-n", 7, "-s", 5 * MiB, "--no-free")
    assert usage_of(tracer, c.pid)[0].live == 7 * 6 * MiB
    before = tracer.object_count()
    c.kill()
    evs = events_of(tracer, c.pid, wait_for="exit")
    ex = [e for e in evs if e.op == "exit"]
    assert len(ex) == 1 and ex[0].size == 7 * 6 * MiB
    assert usage_of(tracer, c.pid) == {}
    drain(tracer)   # sweeps the dead process's objects from the map
    assert tracer.object_count() <= before - 7 - 2   # 7 pointers + context + primary entries


def test_exec_drops_the_old_image(tracer, build, caller_env):
    # a process that allocates, then execs: the driver's memory goes with the old image
    code = (cuda_prelude(build / "standin" / "libcuda.so.1") +
            "p=ctypes.c_uint64(); cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(9<<20));"
            "print('ready',flush=True); input(); os.execv('/bin/sleep',['sleep','30'])")
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=caller_env)
    try:
        assert p.stdout.readline().strip() == "ready"
        assert usage_of(tracer, p.pid)[0].live == 10 * MiB   # 9 MiB in 2 MiB pages
        p.stdin.write("\n")
        p.stdin.flush()
        ex = [e for e in events_of(tracer, p.pid, wait_for="exec") if e.op == "exec"]
        assert len(ex) == 1 and ex[0].size == 10 * MiB
        assert usage_of(tracer, p.pid) == {}
    finally:
        p.kill()
        p.wait()


def test_fork_child_starts_empty_and_parent_keeps_its_bytes(tracer, build, caller_env):
    code = (cuda_prelude(build / "standin" / "libcuda.so.1") +
            "p=ctypes.c_uint64(); cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(6<<20));\n"
            "r,w=os.pipe(); pid=os.fork()\n"
            "if pid==0:\n"
            "    cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(1<<20)); os.write(w,b'x'); os.read(0,1); os._exit(0)\n"
            "os.read(r,1); print('ready', pid, flush=True); input(); os.waitpid(pid,0)")
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=caller_env)
    try:
        line = p.stdout.readline().split()
        child = int(line[1])
        parent_u, child_u = usage_of(tracer, p.pid), usage_of(tracer, child)
        assert parent_u[0].live == 6 * MiB and parent_u[0].n_alloc == 1
        assert child_u[0].live == 1 * MiB and child_u[0].n_alloc == 1 and child_u[0].contexts == 0
    finally:
        p.kill()
        p.wait()
        os.kill(child, signal.SIGKILL) if "child" in locals() else None


def test_recheck_sits_on_the_emulated_push_r12_like_the_driver(build):
    """The stand-in's admitted entry points begin like driver 580's (push %rbp; mov %rsp,%rbp;
    push %r12), so the enforcer's recheck goes on the push at +4, emulated, as on the H100
    (`convgpu doctor` says so), not on the single-stepped mov at +1."""
    from convgpu.cli.doctor import _recheck_check
    from convgpu.probes import loader
    from convgpu.probes.libs import Library
    from convgpu.probes.table import ADMITTED
    sites = loader.recheck_sites(str(build / "standin" / "libcuda.so.1"))
    assert sites == {sym: (4, "emulated") for sym in ADMITTED}
    path = str(build / "standin" / "libcuda.so.1")
    c = _recheck_check(Library("cuda", path, (0, 0), path))
    assert c.ok and c.detail.endswith(f"+4 emulated: {len(ADMITTED)} symbol(s)"), c


def taken_again(tracer, code, caller_env, frees):
    """Runs `code`, whose thread frees X while the driver holds the free's return for 1 s
    (CONVGPU_STANDIN_FREE_RETURN_MS) and whose main thread meanwhile gets X again: the new
    object stays counted, and the frees seen are `frees` [(api, bytes)]."""
    env = dict(caller_env, CONVGPU_STANDIN_FREE_RETURN_MS="1000")
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert p.stdout.readline().split() == ["ready", "True"]     # the same address or handle, again
        assert usage_of(tracer, p.pid)[0].live == frees[0][1]
        assert [(e.api, e.size) for e in events_of(tracer, p.pid) if e.op == "free"] == frees
    finally:
        p.kill()
        p.wait()


VMM_LINES = (   # cuMemCreate's CUmemAllocationProp: pinned, on device 0 (location at offset 8)
    "prop=(ctypes.c_int*16)(); prop[0]=1; prop[2]=1; prop[3]=0\n"
    "def create(n):\n"
    "    h=ctypes.c_uint64(); assert cu.cuMemCreate(ctypes.byref(h), ctypes.c_size_t(n), prop, ctypes.c_ulonglong(0)) == 0; return h.value\n")


def test_a_handle_given_out_again_before_its_release_returns_is_the_new_object(tracer, build, caller_env):
    """The same race for VMM handles: thread A's cuMemRelease of H has given the memory back
    but not yet returned (CONVGPU_STANDIN_FREE_RETURN_MS; the stand-in gives the last released
    handle value out again, as a driver may) when the main thread's cuMemCreate gets H. That
    object's 64 MiB stay counted after A's release returns. Before, the release's return
    looked H up then and released the new object: its bytes left the books while held."""
    code = (cuda_prelude(build / "standin" / "libcuda.so.1") + VMM_LINES +
            "import threading, time\n"
            "x=create(64<<20); go=threading.Event()\n"
            "t=threading.Thread(target=lambda: (cu.cuCtxSetCurrent(c), go.wait(), cu.cuMemRelease(ctypes.c_uint64(x)))); t.start()\n"
            "go.set(); time.sleep(0.3); y=create(64<<20); t.join()\n"
            "print('ready', x == y, flush=True); input()")
    taken_again(tracer, code, caller_env, [("cuMemRelease", 64 * MiB)])   # x's object, once


def test_one_handle_released_by_eight_threads_at_once_leaves_the_books_once(tracer, build, caller_env):
    """A container's own race on one handle: eight threads release the same 64 MiB handle at
    once (the driver's return held 0.3 s, so all eight are inside it together). The driver
    takes one release, refuses seven; the books give the 64 MiB back exactly once, and keep the
    other handle's 64 MiB."""
    code = (cuda_prelude(build / "standin" / "libcuda.so.1") + VMM_LINES +
            "import threading\n"
            "x=create(64<<20); keep=create(64<<20); go=threading.Barrier(8); rcs=[]\n"
            "def rel():\n    cu.cuCtxSetCurrent(c); go.wait(); rcs.append(cu.cuMemRelease(ctypes.c_uint64(x)))\n"
            "ts=[threading.Thread(target=rel) for _ in range(8)]; [t.start() for t in ts]; [t.join() for t in ts]\n"
            "print('ready', sorted(rcs).count(0), flush=True); input()")
    env = dict(caller_env, CONVGPU_STANDIN_FREE_RETURN_MS="300")
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert p.stdout.readline().split() == ["ready", "1"]          # one release taken by the driver
        assert usage_of(tracer, p.pid)[0].live == 64 * MiB            # `keep` alone
        frees = [e for e in events_of(tracer, p.pid) if e.op == "free"]
        assert [(e.api, e.size) for e in frees if e.size] == [("cuMemRelease", 64 * MiB)]
    finally:
        p.kill()
        p.wait()


def test_an_address_taken_again_before_the_free_returns_is_the_new_block(tracer, build, caller_env):
    """The driver gives a freed address out again before the free returns: thread A's free of X
    is still running (CONVGPU_STANDIN_FREE_RETURN_MS) when the main thread allocates the same
    size and gets X. That block is the process's: its 128 MiB stay counted after A's free returns.
    Before, the free's return settled whatever was at X then, the new block: the books lost it
    while the driver held it (bench/torture.py: a container 128 MiB over its limit)."""
    code = (cuda_prelude(build / "standin" / "libcuda.so.1") +
            "import threading, time\n"
            "x=ctypes.c_uint64(); go=threading.Event()\n"   # the thread (its stack) made first: x's hole is the top one
            "t=threading.Thread(target=lambda: (cu.cuCtxSetCurrent(c), go.wait(), cu.cuMemFree_v2(x))); t.start()\n"
            "cu.cuMemAlloc_v2(ctypes.byref(x), ctypes.c_size_t(128<<20)); go.set(); time.sleep(0.3)\n"
            "y=ctypes.c_uint64(); cu.cuMemAlloc_v2(ctypes.byref(y), ctypes.c_size_t(128<<20)); t.join()\n"
            "print('ready', x.value == y.value, flush=True); input()")
    taken_again(tracer, code, caller_env, [("cuMemFree_v2", 128 * MiB)])   # X's first block, once
