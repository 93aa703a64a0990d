"""One process on two GPUs under the enforcer (stand-in driver with two devices, in-process
enforcer, real probes and cgroups): its first context on the second GPU places it there too,
and what it already holds on the first is not counted a second time."""
import logging
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import (GiB, MiB, inprocess_enforcer, lines_until, need, proc_state, remove_cgroup, serving,
                      until, wait_state)

pytestmark = pytest.mark.system

# 600 MiB on GPU0, a context and 100 MiB on GPU1, then 300 MiB more on GPU0: 900 MiB there,
# under the 1 GiB limit. Counted twice, GPU0 would read 1.5 GiB and stall the last allocation.
SCRIPT = r"""
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
def ok(rc, what):
    if rc:
        sys.exit(f"{what}: {rc}")
ok(lib.cuInit(0), "cuInit")
ctx = [ctypes.c_void_p(), ctypes.c_void_p()]
ptr = ctypes.c_uint64()
def on(dev, mib):
    if not ctx[dev].value:
        ok(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx[dev]), dev), "retain")
    ok(lib.cuCtxSetCurrent(ctx[dev]), "set current")
    ok(lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(mib << 20)), f"alloc {mib} MiB on {dev}")
    print(f"GPU{dev} +{mib}", flush=True)
on(0, 600)
on(1, 100)
on(0, 300)
print("ready", flush=True)
sys.stdin.readline()
"""


def test_a_first_context_on_a_second_gpu_does_not_count_the_first_twice(root, build, cgroups, caller_env):
    lib = str(build / "standin" / "libcuda.so.1")
    enf = inprocess_enforcer(lib, "two", GiB, {0: 4 * GiB, 1: 4 * GiB})
    cg = cgroups("two")
    env = dict(caller_env, CONVGPU_STANDIN_DEVICES="2")
    with serving(enf):
        p = subprocess.Popen(["/bin/sh", "-c", f'echo $$ > {cg}/cgroup.procs && exec "$0" "$@"', sys.executable,
                              "-c", SCRIPT, lib], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        try:
            out: list = []
            lines_until(p.stdout, lambda line: line.strip() == "ready", out, 20, "the two-GPU process")
            assert [x.strip() for x in out] == ["GPU0 +600", "GPU1 +100", "GPU0 +300", "ready"]
            assert proc_state(p.pid) != "T"
            box = next(b for b in enf.books.boxes.values() if b.name == "two")
            until(lambda: enf.books.usage(box, 0)[:2] == (900 * MiB, 1), 5, "GPU0's usage settled")
            assert enf.books.usage(box, 0)[:2] == (900 * MiB, 1) and enf.books.usage(box, 1)[:2] == (100 * MiB, 1)
            assert box.adopted == {} and box.stalls == 0
        finally:
            p.kill()
            p.wait()


# Holds 512 MiB on its GPU, then (on "go") asks for 768 MiB more: 1.25 GiB, over a 1 GiB limit.
OVER = r"""
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
dev = int(sys.argv[2])
def ok(rc, what):
    if rc:
        sys.exit(f"{what}: {rc}")
ok(lib.cuInit(0), "cuInit")
ctx, ptr = ctypes.c_void_p(), ctypes.c_uint64()
ok(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "retain")
ok(lib.cuCtxSetCurrent(ctx), "set current")
ok(lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(512 << 20)), "alloc 512 MiB")
print("held", flush=True)
sys.stdin.readline()
ok(lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(768 << 20)), "alloc 768 MiB")
print("allocated", flush=True)
sys.stdin.readline()
"""


def test_freezer_thaws_a_container_stalled_on_two_gpus_once_both_are_granted(root, build, cgroups, caller_env, caplog):
    """--stall freezer-v1: one process of a container stalled over its limit on GPU0, another on
    GPU1. Raising the limit grants both; the container is thawed once, after the second grant.
    (It was thawed at GPU0's grant, so GPU1's process ran into its call with no grant yet and
    was stopped again: "resumed without a grant (SIGCONT from outside?)".)"""
    from convgpu.enforcer.serving import server
    from convgpu.enforcer.tenants.containers import cgroup_layout
    from convgpu.enforcer.failsafe.stall import make_stopper
    lay = cgroup_layout()
    need(lay.mode == "hybrid" and lay.freezer_v1_root is not None, "no v1 freezer (not a hybrid host)")
    lib = str(build / "standin" / "libcuda.so.1")
    enf = inprocess_enforcer(lib, "frz2", GiB, {0: 4 * GiB, 1: 4 * GiB}, stopper=make_stopper("freezer-v1"))
    cg = cgroups("frz2")
    v1 = Path(lay.freezer_v1_root) / cg.relative_to(lay.v2_root)
    v1.mkdir(parents=True, exist_ok=True)
    env = dict(caller_env, CONVGPU_STANDIN_DEVICES="2")
    lock, done, procs = threading.Lock(), threading.Event(), []

    def loop():   # the enforcer's loop, which the test can hold between two steps
        while not done.is_set():
            with lock:
                enf.step()
                server.serve(enf.sel, 0.01)
            time.sleep(0.001)

    caplog.set_level(logging.INFO, logger="convgpu")
    enf.start()
    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        for dev in (0, 1):
            procs.append(subprocess.Popen(
                ["/bin/sh", "-c", f'echo $$ > {cg}/cgroup.procs && echo $$ > {v1}/cgroup.procs && exec "$0" "$@"',
                 sys.executable, "-c", OVER, lib, str(dev)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env))
            lines_until(procs[-1].stdout, lambda line: line == "held", [], 20, f"GPU{dev}'s process")
        box = next(b for b in enf.books.boxes.values() if b.name == "frz2")
        with lock:   # both calls reach BPF, which stops each at its entry, before the loop sees either
            for p in procs:
                p.stdin.write("go\n")
                p.stdin.flush()
            for p in procs:
                wait_state(p.pid, "T")
        until(lambda: set(box.waiting) == {0, 1} and all(w.over_limit for w in box.waiting.values()),
              10, "both waiters over the limit")
        assert (v1 / "freezer.state").read_text().strip() == "FROZEN"
        with lock:   # as the control socket would, in the loop's thread
            enf.runtime.set_limit("frz2", 2 * GiB)
        for dev, p in enumerate(procs):
            lines_until(p.stdout, lambda line: line == "allocated", [], 20, f"GPU{dev}'s process")
        with lock:   # a stop BPF made before those calls ran has its event in the ring buffer now
            enf.step()
            assert box.restalls == 0
            assert not [r.getMessage() for r in caplog.records if "resumed without a grant" in r.getMessage()]
            assert box.waiting == {} and (v1 / "freezer.state").read_text().strip() == "THAWED"
            assert [enf.books.usage(box, d)[:2] for d in (0, 1)] == [(1280 * MiB, 1), (1280 * MiB, 1)]
            assert [box.assigned[d] for d in (0, 1)] == [2 * GiB, 2 * GiB]
    finally:
        for p in procs:
            p.kill()
            p.wait()
        done.set()
        t.join(timeout=10)
        enf.close()
        remove_cgroup(v1)


SIBLING = r"""
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
ctx, ptr = ctypes.c_void_p(), ctypes.c_uint64()
assert lib.cuInit(0) == 0 and lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0 and lib.cuCtxSetCurrent(ctx) == 0
print("held", flush=True)
for line in sys.stdin:
    print("alloc", lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(1 << 20)), flush=True)
"""


def test_freezer_thaws_the_rest_of_a_container_when_its_waiter_dies(root, build, cgroups, caller_env):
    """--stall freezer-v2: a container's waiter (over its limit) is killed while the container is
    frozen; its sibling runs again at once. (The wait went with the process, and nothing thawed
    the container: the sibling stayed frozen for good.)"""
    from convgpu.enforcer.tenants.containers import cgroup_layout
    from convgpu.enforcer.failsafe.stall import make_stopper, v2_has_freeze
    lay = cgroup_layout()
    need(lay.v2_root is not None and v2_has_freeze(lay.v2_root), "no cgroup2 freezer")
    lib = str(build / "standin" / "libcuda.so.1")
    enf = inprocess_enforcer(lib, "frzgone", GiB, stopper=make_stopper("freezer-v2"))
    cg = cgroups("frzgone")
    join = ["/bin/sh", "-c", f'echo $$ > {cg}/cgroup.procs && exec "$0" "$@"', sys.executable, "-c"]
    procs = []
    with serving(enf):
        try:
            procs.append(subprocess.Popen(join + [SIBLING, lib], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          text=True, env=caller_env))
            lines_until(procs[0].stdout, lambda line: line == "held", [], 20, "the sibling")
            procs.append(subprocess.Popen(join + [OVER, lib, "0"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          text=True, env=caller_env))
            lines_until(procs[1].stdout, lambda line: line == "held", [], 20, "the waiter")
            box = next(b for b in enf.books.boxes.values() if b.name == "frzgone")
            procs[1].stdin.write("go\n")
            procs[1].stdin.flush()
            until(lambda: 0 in box.waiting and box.waiting[0].over_limit, 10, "the waiter over its limit")
            assert (cg / "cgroup.freeze").read_text().strip() == "1"
            procs[1].kill()
            assert procs[1].wait(timeout=10) == -9
            until(lambda: (cg / "cgroup.freeze").read_text().strip() == "0", 10, "the container thawed")
            procs[0].stdin.write("go\n")
            procs[0].stdin.flush()
            assert lines_until(procs[0].stdout, lambda line: line.startswith("alloc"), [], 10, "the sibling") == "alloc 0"
            # (box.restalls may be 1: the SIGCONT sent after the freeze can let the waiter reach
            # its recheck before the freezer traps it, which stops it again; 1 run in ~6 here.
            # That is the recheck doing its job, not this test's case.)
            assert box.waiting == {}
        finally:
            for p in procs:
                p.kill()
                p.wait()
