"""Issue 33, attack 5: a process the enforcer never places (it never calls an admitted entry
point) made a `threads` entry at every probed call, counted in no container's quota; its
threads, each calling cuMemGetInfo_v2 and sleeping, filled the map (shrunk to 3,000 entries
here; 65,536 on stock maps), and a full map admitted: a new process then took 2,048 MiB under
256 MiB with no placement, no stall, no log. Now (bpf/admit.bpf.c call_enter) an unplaced
process makes an entry only at an admitted call, which stops it until it is placed and counted;
and a call that finds the map full anyway (more entries than the maps were sized for, all
counted) is killed before it runs, never let through, with one log line. Real enforcer over a
program built with MAX_THREADS=3000 on the stand-in driver; every process as nobody, each in a
cgroup of its own."""
import pytest

from conftest import GiB, MiB, lines_until, read_until, run_dir_for, serving, until, wait_state
from failclosed import allocs, logged, own_lib, python_as_nobody, quiet_logs  # noqa: F401 (fixture)

pytestmark = pytest.mark.system
LIMIT = 256 * MiB
MAP = 3000
# N threads, each calls cuMemGetInfo_v2 once and sleeps until stdin says
FILL = """
import threading
threading.stack_size(256 << 10)
n, done, lock, go = int(os.environ['FILL']), [0], threading.Lock(), threading.Event()
def one():
    f, t = ctypes.c_size_t(), ctypes.c_size_t()
    cu.cuMemGetInfo_v2(ctypes.byref(f), ctypes.byref(t))
    with lock:
        done[0] += 1
    go.wait()
for _ in range(n):
    threading.Thread(target=one, daemon=True).start()
while done[0] < n:
    threading.Event().wait(0.05)
print('filled', n, flush=True)
sys.stdin.readline()
"""
TAKE = allocs(4, 512 * MiB)


def small_maps_enforcer(lib, tag: str, **kw):
    """inprocess_enforcer's, over a program whose threads map holds MAP entries."""
    from convgpu.enforcer.daemon import Enforcer
    from convgpu.enforcer.tenants.limits import LimitRules
    from convgpu.probes.tracer import Tracer
    run_dir = run_dir_for(tag)
    return Enforcer(Tracer(libraries=(str(lib),), discover=False, cflags=(f"-DMAX_THREADS={MAP}",)), "fifo",
                    {0: 4 * GiB}, LimitRules({}, LIMIT), run_dir=run_dir, state_dir=run_dir, ctx_overhead=0, **kw)


def top_up(threads) -> int:
    """Entries of no process (tgids above pid_max) until the map takes no more; how many. A
    preallocated BPF hash map holds a few entries beyond max_entries (per-CPU free lists)."""
    import ctypes as ct
    n = 0
    while n < 1024:
        try:
            threads[ct.c_ulonglong((5_000_000 + n) << 32)] = threads.Leaf()
        except Exception:   # bcc: "Could not update table": E2BIG
            return n
        n += 1
    raise AssertionError("the threads map never filled")


def entries_of(enf, pid: int) -> int:
    return sum(1 for k in enf.tracer.b[b"threads"].keys() if k.value >> 32 == pid)


def test_row33_5_an_unplaced_process_cannot_fill_the_threads_map(root, own_lib, cgroups, env5, caplog):
    quiet_logs(caplog)
    enf = small_maps_enforcer(own_lib, "r33-5a")
    procs = []
    with serving(enf):
        try:
            filler = python_as_nobody(cgroups("filler"), own_lib, dict(env5, FILL=str(MAP)), FILL, context=False)
            procs.append(filler)
            assert read_until(filler, "filled", timeout=120) == [f"filled {MAP}"]
            # before: 3,000 entries, counted in no container's bucket; now none
            assert entries_of(enf, filler.pid) == 0
            assert not any(filler.pid in c["pids"] for c in enf.status()["containers"])
            taker = python_as_nobody(cgroups("taker"), own_lib, env5, TAKE)
            procs.append(taker)
            out: list = []
            assert read_until(taker, "context", timeout=30) == ["context"]
            # before: "alloc 1" .. "alloc 4", 2,048 MiB with no placement; now placed and stopped
            wait_state(taker.pid, "T")
            [line] = logged(caplog, "container taker GPU0: needs 512.0 MiB, above its limit 256.0 MiB")
            [box] = [c for c in enf.status()["containers"] if taker.pid in c["pids"]]
            assert box["gpus"]["0"]["used"] == 0 and box["map_quota"]["threads"] == 1
            assert taker.poll() is None and not out
        finally:
            for p in procs:
                p.kill()
                p.wait()


def test_row33_5_a_call_that_finds_the_threads_map_full_is_killed(root, own_lib, cgroups, env5, caplog):
    """Counted entries can fill it too, where more containers sit at their thread quotas than the
    maps were sized for (here: one container, its quota 4,096 above the map's 3,000): the next
    call that needs an entry is killed before it runs, whoever makes it."""
    quiet_logs(caplog)
    enf = small_maps_enforcer(own_lib, "r33-5b")
    procs = []
    with serving(enf):
        try:
            # placed (its context), then its threads' entries count in its bucket: the map fills
            filler = python_as_nobody(cgroups("placed"), own_lib, dict(env5, FILL=str(MAP - 1)), FILL)
            procs.append(filler)
            assert read_until(filler, "filled", timeout=120) == [f"filled {MAP - 1}"]
            until(lambda: len(enf.tracer.b[b"threads"]) == MAP, 10, "the map did not fill")
            # the quota's count follows the map's (one loop pass later under load: 2,999 once)
            until(lambda: [c["map_quota"]["threads"] for c in enf.status()["containers"]
                           if filler.pid in c["pids"]] == [MAP], 10, "the container's quota count")
            dummies = top_up(enf.tracer.b[b"threads"])    # the kernel's hash map takes a few more
            taker = python_as_nobody(cgroups("taker"), own_lib, env5, TAKE)
            procs.append(taker)
            out: list = []
            try:
                lines_until(taker.stdout, lambda line: line == "done", out, 30, "taker")
            except AssertionError:
                pass
            assert taker.wait(timeout=30) == -9 and out == [], out   # killed at its context
            [line] = logged(caplog, f"pid {taker.pid} thread {taker.pid}: the BPF threads map is full")
            assert line.endswith("cuDevicePrimaryCtxRetain cannot be tracked: killed before it ran (more "
                                 "containers at their thread quotas than the maps hold; see --max-threads)"), line
            assert filler.poll() is None     # the map's holder runs on: only the untracked call died
        finally:
            for p in procs:
                p.kill()
                p.wait()


# thread B of a process whose container is at its thread quota: its allocation has no entry.
# COUNTED: a placed thread counts in its container's quota at its next probed call, at the
# latest (a placement stop ended by a restall skips the recheck's count)
COUNTED = "f, t = ctypes.c_size_t(), ctypes.c_size_t(); cu.cuMemGetInfo_v2(ctypes.byref(f), ctypes.byref(t))\n"
PAST_QUOTA = COUNTED + """
import threading
p = ctypes.c_uint64()
def b():
    cu.cuCtxSetCurrent(c)
    print('b', cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(128 << 20)), flush=True)
print('context', flush=True)
sys.stdin.readline()
threading.Thread(target=b).start()
"""


def test_row33_5_a_thread_past_its_thread_quota_is_killed_not_let_through_later(root, own_lib, cgroups, env5,
                                                                               caplog):
    """The same family: a thread past its container's thread quota has no entry. It was stopped,
    and once the container had room again (a sibling process exited) resumed: its call then ran
    unreserved and was accounted nowhere (128 MiB on the card, 0 in convgpu's books). Killed now,
    whatever --over-limit says."""
    from convgpu.enforcer.quotas import MapQuota
    from conftest import inprocess_enforcer
    quiet_logs(caplog)
    enf = inprocess_enforcer(own_lib, "r33-5c", LIMIT, capacity={0: 4 * GiB}, ctx_overhead=0,
                             quota=MapQuota(threads=2))
    cg = cgroups("quota")
    procs = []
    with serving(enf):
        try:
            first = python_as_nobody(cg, own_lib, env5, COUNTED + "print('ready', flush=True); sys.stdin.readline()")
            procs.append(first)
            assert read_until(first, "ready", timeout=30) == ["ready"]     # 1 thread entry of 2
            second = python_as_nobody(cg, own_lib, env5, PAST_QUOTA)          # its main thread: 2 of 2
            procs.append(second)
            out = read_until(second, "context", timeout=30)
            until(lambda: any(second.pid in c["pids"] for c in enf.status()["containers"]), 10, "not placed")
            [box] = enf.status()["containers"]
            assert box["map_quota"]["threads"] == 2, box["map_quota"]     # its quota, exactly
            second.stdin.write("\n")     # thread B: its allocation, past the quota
            second.stdin.flush()
            try:
                lines_until(second.stdout, lambda line: line.startswith("b "), out, 15, "second")
            except AssertionError:
                pass
            first.stdin.write("\n")       # room again: before, the stopped thread was resumed
            first.stdin.flush()
            assert first.wait(timeout=10) == 0
            try:
                lines_until(second.stdout, lambda line: line.startswith("b "), out, 5, "second")
            except AssertionError:
                pass
            # before: "b 0", 128 MiB on the card and none in convgpu's books; now killed at the call
            assert second.wait(timeout=10) == -9 and out == ["context"], out
            [line] = logged(caplog, f"pid {second.pid} at its quota in the BPF maps")
            assert "killed (a thread past its container's thread quota: its call cannot be tracked) before " \
                   "its cuMemAlloc_v2 ran" in line, line
        finally:
            for p in procs:
                p.kill()
                p.wait()
