"""Which stopped calls of one container resume (enforcer/within.py), without a kernel or an
Enforcer: the books as plain values."""
from hypothesis import given, settings, strategies as st

from convgpu.enforcer import policies
from convgpu.enforcer.books import Ask
from convgpu.enforcer.within import newcomer_safe, resumable

MiB = 1 << 20
CTX = 544 * MiB


def ask(pid, size, since, tid=None, **kw):
    return Ask(pid=pid, tid=tid or pid, size=size, since=since, **kw)


def pids(go):
    return [[a.tid for a in u] for u in go]


def test_holders_go_before_newcomers_and_each_takes_its_room():
    """Room for two of three: the holder (stopped last) first, then the older newcomer."""
    units = [[ask(1, 256 * MiB, 1.0)], [ask(2, 256 * MiB, 2.0)], [ask(3, 256 * MiB, 3.0)]]
    holds = {1: (CTX, CTX), 2: (CTX, CTX), 3: (CTX + 256 * MiB, CTX)}
    go = resumable(units, 512 * MiB, 4096 * MiB, holds)
    assert pids(go) == [[3], [1]]


def test_a_newcomers_context_never_takes_the_room_a_holder_needs_to_finish():
    """Issue 23's server and workers: the holder asks for 512 MiB it cannot have yet (room
    300 MiB); the newcomer's 256 MiB context would fit the room now, but after it the holder
    could never reach its 512 within the limit: the newcomer waits. Alone, it goes."""
    holder = [ask(1, 512 * MiB, 1.0)]
    fresh = [ask(2, 256 * MiB, 2.0, first=True)]
    holds = {1: (CTX + 512 * MiB, CTX), 2: (0, 0)}
    assert resumable([holder, fresh], 300 * MiB, 300 * MiB, holds) == []
    assert pids(resumable([fresh], 300 * MiB, 300 * MiB, {})) == [[2]]
    # and with room for both, both go (the holder first)
    assert pids(resumable([holder, fresh], 2048 * MiB, 2048 * MiB, holds)) == [[1], [2]]


def test_over_limit_units_never_go_and_a_process_held_whole_goes_whole():
    whole = [ask(4, 128 * MiB, 1.0, tid=41), ask(4, 128 * MiB, 1.5, tid=42)]
    over = [ask(5, 64 * MiB, 0.5, over_limit=True)]
    assert pids(resumable([over, whole], 200 * MiB, 4096 * MiB, {})) == []
    assert pids(resumable([over, whole], 256 * MiB, 4096 * MiB, {})) == [[41, 42]]


def test_a_call_whose_reservation_bpf_kept_needs_no_room_again():
    """A call stopped again at its recheck keeps its reservation (BPF EF_RESERVED), which is
    in what the container has taken already: counted again, it would wait on itself."""
    kept = [ask(6, 512 * MiB, 1.0, reserved=True)]
    assert pids(resumable([kept], 0, 0, {})) == [[6]]
    assert resumable([[ask(6, 512 * MiB, 1.0)]], 0, 0, {}) == []


def test_settling_is_asked_for_first_contexts_only_with_the_room_they_leave():
    asked = []

    def settling(pid, room_after):
        asked.append((pid, room_after))
        return pid == 8
    units = [[ask(7, CTX, 1.0, first=True)], [ask(8, CTX, 2.0, first=True)], [ask(9, 64 * MiB, 3.0)]]
    go = resumable(units, 2 * CTX + 64 * MiB, 8192 * MiB, {}, settling)
    assert pids(go) == [[7], [9]]
    assert asked == [(7, CTX + 64 * MiB), (8, 64 * MiB)]


sizes = st.integers(1, 8).map(lambda n: n * 64 * MiB)


@st.composite
def containers(draw):
    n = draw(st.integers(1, 6))
    units, holds = [], {}
    for pid in range(1, n + 1):
        held = draw(st.sampled_from([0, CTX, CTX + draw(sizes)]))
        holds[pid] = (held, min(held, CTX))
        units.append([ask(pid, draw(sizes), float(draw(st.integers(0, 9))))])
    limit = draw(st.integers(1, 40)) * 128 * MiB
    taken = sum(h for h, _ in holds.values())
    return units, holds, limit, taken


@settings(max_examples=300, deadline=None)
@given(containers())
def test_what_resumes_fits_and_leaves_every_waiting_holder_able_to_finish(c):
    """Whatever the shape: what goes fits the room, and after it the holders still waiting
    can all finish in some order within the limit (no wait the container makes for itself)."""
    units, holds, limit, taken = c
    room = limit - taken
    go = resumable(units, room, room, holds)
    assert sum(a.need for u in go for a in u) <= max(room, 0)
    gone = {u[0].pid for u in go}
    left = [u for u in units if u[0].pid not in gone and holds[u[0].pid][0] > holds[u[0].pid][1]]
    if any(holds[p][0] <= holds[p][1] for p in gone) and left:
        spare = room - sum(a.need for u in go for a in u)
        claims = [policies.Claim(str(u[0].pid), holds[u[0].pid][0] + u[0].size, holds[u[0].pid][0]) for u in left]
        assert len(policies.finishers(claims, spare + sum(x.held for x in claims))) == len(claims)


def test_newcomer_safe_counts_only_holders_not_yet_going():
    holder = [ask(1, 512 * MiB, 1.0)]
    fresh = [ask(2, CTX, 2.0, first=True)]
    holds = {1: (CTX + 512 * MiB, CTX)}
    assert not newcomer_safe(fresh, [holder, fresh], [], holds, 256 * MiB)
    assert newcomer_safe(fresh, [holder, fresh], [holder], holds, 256 * MiB)   # it goes first
    assert newcomer_safe(holder, [holder, fresh], [], holds, 0)                # a holder: no check
