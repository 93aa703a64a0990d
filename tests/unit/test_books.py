"""The books as a value (enforcer/books.py), without an Enforcer or a kernel: plain Boxes,
Waits and Asks, BPF's counters given by a dict, and the sums the decisions read."""
import time
from types import SimpleNamespace

from convgpu.enforcer.books import CIRCULAR_S, Ask, Books, Box, Exit, Wait
from convgpu.enforcer.tenants.containers import Container

MiB, GiB = 1 << 20, 1 << 30
CTX = 500 * MiB


def books(whole=lambda pid: False, freezer=False, physical=None):
    state = {}   # (container key, dev) -> BPF's cgstate counters
    b = Books({0: 8 * GiB}, physical or {0: 8 * GiB}, lambda box, dev: state.get((box.key, dev)),
              lambda dev: CTX, lambda box, dev: box.limit, whole=whole, freezer=freezer)
    return b, state


def box(b, key, name, limit, assigned, pids):
    x = Box(key, Container("cgroup", f"/{name}", f"/{name}"), name, 0.0, limit, "test", set(pids),
            assigned={0: assigned})
    b.boxes[x.container.id] = b.by_key[key] = x
    return x


def counters(used=0, contexts=0, reserved=0, tearing=0):
    return SimpleNamespace(used=used, contexts=contexts, reserved=reserved, tearing=tearing)


def test_taken_held_and_demand_from_counters_and_asks():
    b, state = books()
    x = box(b, 1, "a", 2 * GiB, 2 * GiB, [10, 11])
    state[(1, 0)] = counters(used=300 * MiB, contexts=2, reserved=64 * MiB)
    x.shim_pending[0] = 16 * MiB
    x.going[0] = {12: Ask(11, 12, 128 * MiB, 0.0)}               # resumed, not past its recheck yet
    x.waiting[0] = Wait(0.0, {10}, unreserved=8 * MiB,
                        asks={10: Ask(10, 10, 256 * MiB, 0.0), 13: Ask(10, 13, 32 * MiB, 0.0, reserved=True)})
    held = 300 * MiB + 2 * CTX + 16 * MiB
    assert b.held(x, 0) == held
    assert b.taken(x, 0) == held + 64 * MiB + 128 * MiB
    # the reserved ask is in BPF's reserved already: the demand adds only the other one
    assert b.demand(x, 0) == b.taken(x, 0) + 8 * MiB + 256 * MiB


def test_a_waiting_process_whose_threads_run_is_paused_only_once_they_stop_freeing():
    """Issue 23 (the H100 run of 2026-11-25f): a process with one thread held and the others
    running and freeing is not paused, so its unused assignment is not reclaimed nor the GPU
    called deadlocked; once no free came for CIRCULAR_S it is. Held whole, at once."""
    b, state = books(whole=lambda pid: False)
    x = box(b, 1, "thr", 2 * GiB, 2 * GiB, [10])
    now = time.monotonic()
    x.waiting[0] = Wait(now, {10}, asks={11: Ask(10, 11, 256 * MiB, now)}, freed_at=now)
    assert not b.paused(x, 0, now + CIRCULAR_S / 2)
    assert b.paused(x, 0, now + CIRCULAR_S)
    whole, _ = books(whole=lambda pid: True)
    y = box(whole, 2, "one", 2 * GiB, 2 * GiB, [20])
    y.waiting[0] = Wait(now, {20}, asks={20: Ask(20, 20, 256 * MiB, now)}, freed_at=now)
    assert whole.paused(y, 0, now)
    # a container with a process not waiting is never paused
    y.pids.add(21)
    assert not whole.paused(y, 0, now + 60)


def test_claims_room_and_free():
    """The banker's view: a running container claims its assignment, a paused waiter what it
    holds (stuck if over its limit); an exit of a container gone still takes the card's room."""
    b, state = books(whole=lambda pid: True)
    run = box(b, 1, "run", 4 * GiB, 3 * GiB, [10])
    state[(1, 0)] = counters(used=GiB)
    wait = box(b, 2, "wait", 4 * GiB, 2 * GiB, [20])
    state[(2, 0)] = counters(used=512 * MiB, contexts=1)
    wait.waiting[0] = Wait(0.0, {20}, asks={20: Ask(20, 20, 8 * GiB, 0.0, over_limit=True)}, over_limit=True)
    claims = {c.id: (c.held, c.stuck) for c in b.claims(0)}
    assert claims == {"/run": (3 * GiB, False), "/wait": (512 * MiB + CTX, True)}
    assert [c.id for c in b.claims(0, but=run)] == ["/wait"]
    b.exits[7] = Exit(30, 0.0, {0: 256 * MiB})   # its container is gone: the card's, not a box's
    assert b.tearing(0) == 256 * MiB
    assert b.room(0) == 8 * GiB - 5 * GiB - 256 * MiB
    assert b.free(0) == 8 * GiB - 5 * GiB - 256 * MiB
