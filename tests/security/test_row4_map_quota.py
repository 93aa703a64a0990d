"""Issue 24 row 4: one container filled the host-wide `objs` map (262,144 entries) with 1-byte
allocations; every other process's objects then went unrecorded, their frees counted as
unknown, and a victim doing 64 MiB alloc+free was stalled "over limit" after 4 rounds while
holding nothing. Now every entry counts against its own container's quota (bpf/admit.bpf.c,
quota_ok): the attacker is stopped (or killed, --over-limit kill) at its quota, before its
call runs, and the victim's rounds stay exact. Real enforcer (in a thread) on the stand-in
driver, attacker and victim in podman containers as nobody."""
import ctypes as ct

import pytest

from conftest import GiB, MiB, _lines, cuda_prelude, inprocess_enforcer, lines_until, proc_state, serving, until
from podman import Container

pytestmark = pytest.mark.system
ROUNDS = 20
LIMIT = 256 * MiB                 # 4 rounds of 64 MiB charged and never freed reach it
ATTACK = 270_000                  # more than the whole map holds (MAX_OBJS 262,144)
QUOTA = 16384                     # the default --max-objects
VICTIM = cuda_prelude("/build/standin/libcuda.so.1") + f"""
p = ctypes.c_uint64()
for i in range({ROUNDS}):
    assert cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t({64 * MiB})) == 0
    assert cu.cuMemFree_v2(p) == 0
    print('round', i + 1, flush=True)
print('done', flush=True)
sys.stdin.readline()
"""


def objects_of(enf, pid: int) -> int:
    return sum(1 for k in enf.tracer.b[b"objs"].keys() if k.tgid == pid)


def box_of(enf, pid: int) -> dict:
    return next(c for c in enf.status()["containers"] if pid in c["pids"])


@pytest.mark.parametrize("over_limit", ["stall", "kill"])
def test_row4_a_container_filling_the_maps_stops_at_its_own_quota(root, build, over_limit):
    enf = inprocess_enforcer(build / "standin" / "libcuda.so.1", f"row4-{over_limit}", LIMIT,
                             capacity={0: 2 * GiB}, over_limit=over_limit)
    attacker = victim = None
    env = {"CONVGPU_STANDIN_CAPACITY": str(4 * GiB)}
    with serving(enf):
        try:
            # started through a shell that waits a moment, so its pid is known before it allocates
            attacker = Container(build, "/bin/sh", "-c", f"sleep 1; exec /build/cgcaller alloc -n {ATTACK} -s 1 --hold",
                                 env=env)
            lines: list = []
            # before: it allocates all of them ("ready"); now: stopped or killed at its quota. Its
            # first call stops it too, until it is placed: a T alone is not the quota's stop (under
            # load, read there, the checks below found it running its 16,382 calls)
            at_quota = (lambda: attacker.p.poll() is not None) if over_limit == "kill" else \
                (lambda: attacker.pid in enf.quotas.held and _state(attacker.pid) == "T")
            until(lambda: _read(attacker, lines) or "ready" in lines or at_quota(), 180,
                  "the attacker neither finished nor stopped")
            victim = Container(build, "/usr/bin/python3", "-c", VICTIM, env=env)
            seen: list = []
            try:
                lines_until(victim.p.stdout, lambda line: line == "done", seen, 60, "victim")
            except AssertionError:
                raise AssertionError(f"the victim stopped after {seen[-1:] or 'no'} round(s) of {ROUNDS}: "
                                     f"{enf.status()['containers']}") from None
            assert seen == [f"round {i + 1}" for i in range(ROUNDS)] + ["done"]
            [u] = [u for u in enf.tracer.usage() if u.pid == victim.pid]
            assert (u.n_alloc, u.n_free, u.live, u.bytes_alloc) == (ROUNDS, ROUNDS, 0, ROUNDS * 64 * MiB)
            v = box_of(enf, victim.pid)
            assert (v["gpus"]["0"]["used"], v["stalls"], v["map_quota"]["hits"]) == (0, 0, 0)
            assert enf.tracer.stats()["unrecorded"] == 0 and enf.tracer.stats()["unknown_free"] == 0

            # the attacker: its quota, exactly, and nothing past it ran
            if over_limit == "kill":
                assert attacker.p.wait(timeout=30) == 137           # SIGKILL, before its call ran
            else:
                assert proc_state(attacker.pid) == "T"
                a = box_of(enf, attacker.pid)
                # one hit: its one allocating thread, stopped at the entry of the call past the
                # quota, stays stopped (its container never has room again while it holds them)
                assert a["map_quota"]["objects"] == QUOTA and a["map_quota"]["hits"] == 1, a["map_quota"]
                assert a["map_quota"]["stopped_pids"] == [attacker.pid]
                # cgcaller: its main thread (the context) and one allocating thread, in one process
                assert (a["map_quota"]["threads"], a["map_quota"]["processes"]) == (2, 1)
                assert objects_of(enf, attacker.pid) == QUOTA       # its context (2 entries) and 16382 bytes
                [ua] = [u for u in enf.tracer.usage() if u.pid == attacker.pid]
                assert (ua.n_alloc, ua.live) == (QUOTA - 2, QUOTA - 2)
                attacker.remove()
            # once it is gone, so are its entries and its bucket
            until(lambda: objects_of(enf, attacker.pid) == 0, 60, "the attacker's objects stayed in the map")
            try:
                until(lambda: len(enf.tracer.b[b"quotas"]) == 1, 30, "the attacker's quota bucket stayed")
            except AssertionError:
                raise AssertionError(f"buckets {[(k.value, v.objs, v.threads, v.procs) for k, v in enf.tracer.b[b'quotas'].items()]}"
                                     f" boxes {[(c['name'], c['pids']) for c in enf.status()['containers']]}") from None
            assert not any(attacker.pid in c["pids"] for c in enf.status()["containers"])
            victim.p.stdin.write("\n")
            victim.p.stdin.flush()
            assert victim.p.wait(timeout=30) == 0
        finally:
            for c in (attacker, victim):
                if c is not None:
                    c.remove()


def _state(pid: int) -> str:
    try:
        return proc_state(pid)
    except OSError:     # gone, or going (ESRCH)
        return "gone"


def _read(c: Container, lines: list) -> bool:
    """Whatever the container printed so far goes into lines (never waits); False."""
    q = _lines(c.p.stdout)
    while not q.empty():
        line = q.get()
        if line is None:
            q.put(None)
            break
        lines.append(line.strip())
    return False


def test_row4_processes_past_the_quota_are_not_placed(root, build, cgroups, env5):
    """`members` is bounded too: with --max-processes 2, a third process of the container is
    not placed (no entry) but stopped at its first call, and placed once one of the two exits."""
    from convgpu.enforcer.quotas import MapQuota
    from conftest import read_until, start_in, wait_state
    enf = inprocess_enforcer(build / "standin" / "libcuda.so.1", "row4-procs", LIMIT, capacity={0: 2 * GiB},
                             quota=MapQuota(processes=2))
    cg = cgroups("many")
    procs = []
    with serving(enf):
        try:
            for _ in range(2):
                procs.append(start_in(cg, build, env5, "alloc", "-n", 1, "-s", MiB, "--hold"))
                read_until(procs[-1], "ready")
            third = start_in(cg, build, env5, "alloc", "-n", 1, "-s", MiB, "--hold")
            procs.append(third)
            until(lambda: third.pid in enf.quotas.held, 20, "the third process was not held at the quota")
            wait_state(third.pid, "T")
            [box] = enf.status()["containers"]
            assert sorted(box["pids"]) == sorted(p.pid for p in procs[:2])
            assert ct.c_uint(third.pid) not in enf.tracer.b[b"members"]
            assert box["map_quota"]["stopped_pids"] == [third.pid] and box["map_quota"]["processes"] == 2
            procs[0].stdin.write("\n")       # one exits: the third is placed and runs
            procs[0].stdin.flush()
            assert procs[0].wait(timeout=20) == 0
            assert f"allocated 1 {MiB} pid={third.pid}" in read_until(third, "ready")
            [box] = enf.status()["containers"]
            assert sorted(box["pids"]) == sorted(p.pid for p in procs[1:])
        finally:
            for p in procs:
                p.kill()
                p.wait()
