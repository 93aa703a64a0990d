"""Scheduling policies (enforcer/policies.py): each policy's pick on hand-worked cases, the
paper's Figure 3 walk-through, the grant loop, and the pure-function guarantees."""
import copy
import itertools
import random

import pytest

from convgpu.enforcer.policies import (POLICIES, Grant, Waiter, assign_new, pick, schedule)

GiB = 1 << 30
MiB = 1 << 20
NAMES = ("fifo", "bf", "ru", "rand", "bfa")
# A capacity with room for every limit in these cases, where they are about each policy's own
# preference: the banker's check never binds (its own tests are in test_safety.py). Without
# one, schedule() takes `free` plus the assignments as the capacity, and several of these
# hand-made states have a limit above that (unsafe from the start).
ROOMY = 64 * GiB


def w(id, created, suspended_at, missing, need, limit=2 * GiB):
    """A waiter missing `missing` bytes to its limit and `need` bytes to its pending request
    (it uses all of its assignment, so request == need). It holds part of its limit
    (assigned > 0: bfa's rule 1) unless missing == limit."""
    assigned = limit - missing
    return Waiter(id=id, created=created, suspended_at=suspended_at, limit=limit,
                  assigned=assigned, used=assigned, request=need)


def rng(seed=0):
    return random.Random(seed)


# Four waiters on which the four deterministic policies all disagree. now = 60, free = 1.5 GiB.
#   id  created  suspended (waited)  missing   assigned
#   w1  1        40  (20 s)          2    GiB  0          oldest container          -> fifo
#   w2  2        10  (50 s)          1    GiB  1    GiB   oldest holding memory     -> bfa
#   w3  3        45  (15 s)          1.25 GiB  0.75 GiB   largest missing <= 1.5    -> bf
#   w4  4        55  ( 5 s)          0.5  GiB  1.5  GiB   suspended last            -> ru
W1 = w("w1", 1, 40, 2 * GiB, 1 * GiB)
W2 = w("w2", 2, 10, 1 * GiB, 1 * GiB)
W3 = w("w3", 3, 45, 5 * GiB // 4, 5 * GiB // 4)
W4 = w("w4", 4, 55, GiB // 2, GiB // 4)
FOUR = [W1, W2, W3, W4]
NOW = 60.0


def test_waiter_properties():
    x = Waiter("x", 0, 0, limit=2 * GiB, assigned=1 * GiB, used=900 * MiB, request=300 * MiB)
    assert x.missing == 1 * GiB
    assert x.need == 176 * MiB  # 900 + 300 - 1024 MiB


@pytest.mark.parametrize("policy, expected", [
    ("fifo", W1),  # created at 1, though suspended after w2
    ("bf", W3),    # fits: w2 (1), w3 (1.25), w4 (0.5); w1 (2) does not. 1.25 is closest to 1.5
    ("ru", W4),    # suspended at 55, the latest
    ("bfa", W2),   # holds 1 GiB of its limit and is the oldest such: first, though bf takes w3
])
def test_each_policy_picks_differently(policy, expected):
    assert pick(policy, FOUR, int(1.5 * GiB), NOW, rng()) == expected


def test_rand_pick_is_the_seeded_choice():
    # rand draws from the candidates in (created, id) order: w1..w4.
    assert pick("rand", FOUR, int(1.5 * GiB), NOW, rng(7)) == random.Random(7).choice(FOUR)


def test_bfa_without_holders_or_overdue_is_bf():
    # Nobody holds memory (all assigned 0), nobody waited over max_wait 60 -> bf's pick.
    fresh = [w(x.id, x.created, x.suspended_at, x.limit, x.need) for x in FOUR]
    free = int(1.5 * GiB)
    assert pick("bfa", fresh, free, NOW, rng(), max_wait=60) == pick("bf", fresh, free, NOW, rng())


# ---- Best-Fit ----

def test_bf_exact_fit_preferred():
    ws = [w("a", 1, 0, GiB // 2, 1), w("b", 2, 0, 1 * GiB, 1), w("c", 3, 0, 2 * GiB, 1)]
    assert pick("bf", ws, 1 * GiB, 0, rng()).id == "b"  # missing == free exactly


def test_bf_closest_below_beats_closer_above():
    # free 1 GiB: a misses 0.75 GiB (0.25 under), b misses 1.1 GiB (only 0.1 over, closer in
    # absolute terms) -- b doesn't fit, so a.
    ws = [w("a", 2, 0, 3 * GiB // 4, 1), w("b", 1, 0, int(1.1 * GiB), 1)]
    assert pick("bf", ws, 1 * GiB, 0, rng()).id == "a"


def test_bf_nothing_fits_least_missing():
    ws = [w("a", 1, 0, 2 * GiB, 1), w("b", 2, 0, 1 * GiB, 1), w("c", 3, 0, 3 * GiB // 2, 1)]
    assert pick("bf", ws, GiB // 2, 0, rng()).id == "b"


def test_ties_by_created_then_id():
    same = [w("b", 1, 5, 1 * GiB, 1), w("a", 1, 5, 1 * GiB, 1), w("c", 0.5, 5, 1 * GiB, 1)]
    for policy in ("fifo", "bf", "ru", "bfa"):
        assert pick(policy, same, 1 * GiB, 100, rng()).id == "c"  # earliest created
        assert pick(policy, same[:2], 1 * GiB, 100, rng()).id == "a"  # same created: by id
        assert pick(policy, same[1::-1], 1 * GiB, 100, rng()).id == "a"  # order irrelevant


# ---- Figure 3 ----
# Capacity 4 GiB. A (limit 1 GiB) and B (limit 2 GiB) arrive and get their limits; C (limit
# 2 GiB) arrives with 1 GiB unassigned -> assign_new gives 1 GiB; D (limit 2 GiB) gets 0.
# C has used its 1 GiB and asks 0.5 GiB more (need 0.5); D asks 1.5 GiB (need 1.5).
# D was suspended after C. B exits: 2 GiB comes back.
def figure3():
    assert [assign_new(1 * GiB, 4 * GiB), assign_new(2 * GiB, 3 * GiB),
            assign_new(2 * GiB, 1 * GiB), assign_new(2 * GiB, 0)] == [1 * GiB, 2 * GiB, 1 * GiB, 0]
    c = Waiter("C", created=3, suspended_at=10, limit=2 * GiB, assigned=1 * GiB,
               used=1 * GiB, request=GiB // 2)
    d = Waiter("D", created=4, suspended_at=11, limit=2 * GiB, assigned=0, used=0,
               request=3 * GiB // 2)
    return [c, d]


FIG3_FIFO = [Grant("C", 1 * GiB, True),    # C (created first) gets its full limit: resumes
             Grant("D", 1 * GiB, False)]   # D gets the rest, 1 GiB < need 1.5: stays paused
FIG3_BF = [Grant("D", 2 * GiB, True)]      # D misses 2 GiB == free exactly: all of it; C waits


def test_figure3_fifo():
    assert schedule("fifo", figure3(), 2 * GiB, 12, rng()) == FIG3_FIFO


def test_figure3_bf():
    assert schedule("bf", figure3(), 2 * GiB, 12, rng()) == FIG3_BF


def test_figure3_ru_rand_bfa():
    ws = figure3()
    # ru: D suspended last -> same as bf.
    assert schedule("ru", ws, 2 * GiB, 12, rng()) == FIG3_BF
    # rand: either order, both seen across seeds.
    seen = {tuple(schedule("rand", ws, 2 * GiB, 12, rng(s))) for s in range(50)}
    assert seen == {tuple(FIG3_FIFO), tuple(FIG3_BF)}
    # bfa: C already holds 1 GiB of its limit -> C first (rule 1), D gets the rest: as fifo,
    # at any time. bf would leave C's 1 GiB idle behind D.
    assert schedule("bfa", ws, 2 * GiB, 12, rng()) == FIG3_FIFO
    assert schedule("bfa", ws, 2 * GiB, 12, rng(), max_wait=0) == FIG3_FIFO


# ---- rand ----

def test_rand_same_seed_same_choices():
    a = [pick("rand", FOUR, GiB, NOW, r).id for r in [rng(3)] for _ in range(50)]
    r = rng(3)
    b = [pick("rand", FOUR, GiB, NOW, r).id for _ in range(50)]
    r = rng(3)
    c = [pick("rand", FOUR[::-1], GiB, NOW, r).id for _ in range(50)]  # input order irrelevant
    assert a == b == c
    assert len(set(b)) == 4


def test_rand_uniform():
    r = rng(12345)
    counts = {x.id: 0 for x in FOUR}
    for _ in range(10_000):
        counts[pick("rand", FOUR, GiB, NOW, r).id] += 1
    assert all(2000 <= n <= 3000 for n in counts.values()), counts


# ---- bfa ----
# Waiters made with missing == limit hold nothing (assigned 0): only rules 2 and 3 apply.

def test_bfa_equals_bf_when_nobody_holds_or_is_overdue():
    r = rng(1)
    for _ in range(300):
        ws = []
        for i in range(r.randrange(1, 7)):
            limit = r.randrange(1, 4 * GiB)
            ws.append(w(f"x{i}", r.randrange(100), r.uniform(50, 100), limit,
                        r.randrange(1, limit + 1), limit=limit))
        free = r.randrange(1, 5 * GiB)
        # now = 100: every waiter waited at most 50 s < max_wait 60.
        assert pick("bfa", ws, free, 100, rng(), 60) == pick("bf", ws, free, 100, rng())
        assert schedule("bfa", ws, free, 100, rng(), 60) == schedule("bf", ws, free, 100, rng())


def test_bfa_holder_first_even_if_it_fits_worse():
    exact = w("exact", 1, 90, 1 * GiB, 1, limit=1 * GiB)   # nothing assigned, fits exactly
    holder = w("holder", 2, 95, 3 * GiB, 1, limit=4 * GiB)  # holds 1 GiB, misses 3: no fit
    assert pick("bf", [exact, holder], 1 * GiB, 100, rng()) == exact
    assert pick("bfa", [exact, holder], 1 * GiB, 100, rng()) == holder
    # holder takes all 1 GiB (need 1 byte -> resumes, still 2 GiB short of its limit).
    assert schedule("bfa", [exact, holder], 1 * GiB, 100, rng(), capacity=ROOMY) == [
        Grant("holder", 1 * GiB, True)]


def test_bfa_holders_oldest_created_first_then_the_rest():
    young = w("young", 5, 10, 1 * GiB, 1)              # holds 1 GiB, waited 90 s
    old = w("old", 3, 99, 1 * GiB, 1)                  # holds 1 GiB, waited 1 s: first
    none = w("none", 1, 0, 2 * GiB, 1, limit=2 * GiB)  # holds nothing, waited 100 s
    assert [g.id for g in schedule("bfa", [young, none, old], 4 * GiB, 100, rng(), 30)] == \
        ["old", "young", "none"]


def test_bfa_overdue_served_first_even_if_it_fits_worse():
    good = w("good", 1, 90, 1 * GiB, 1, limit=1 * GiB)   # exact fit, waited 10 s
    bad = w("bad", 2, 60, 3 * GiB, 1, limit=3 * GiB)     # doesn't fit at all, waited 40 s > 30
    assert pick("bf", [good, bad], 1 * GiB, 100, rng()) == good
    assert pick("bfa", [good, bad], 1 * GiB, 100, rng(), 30) == bad
    assert pick("bfa", [good, bad], 1 * GiB, 100, rng()) == good   # default 180 s: not overdue
    # bad takes all 1 GiB (partial, need 1 byte -> resumes); nothing left for good.
    assert schedule("bfa", [good, bad], 1 * GiB, 100, rng(), 30, capacity=ROOMY) == [
        Grant("bad", 1 * GiB, True)]


def test_bfa_two_overdue_longest_waiting_first():
    a = w("a", 1, 50, 1 * GiB, 1, limit=1 * GiB)   # waited 50 s
    b = w("b", 2, 20, 1 * GiB, 1, limit=1 * GiB)   # waited 80 s: first, though created later
    c = w("c", 3, 95, 1 * GiB, 1, limit=1 * GiB)   # 5 s: after both overdue ones (bf)
    assert pick("bfa", [a, b, c], 3 * GiB, 100, rng(), 30) == b
    assert [g.id for g in schedule("bfa", [a, b, c], 3 * GiB, 100, rng(), 30)] == ["b", "a", "c"]


def test_bfa_boundary_is_strict():
    x = w("x", 2, 70, 3 * GiB, 1, limit=3 * GiB)   # waited exactly 30 s: not overdue
    y = w("y", 1, 90, 1 * GiB, 1, limit=1 * GiB)
    assert pick("bfa", [x, y], 1 * GiB, 100, rng(), 30) == y
    assert pick("bfa", [x, y], 1 * GiB, 100.5, rng(), 30) == x


def test_bfa_leaves_at_most_one_waiter_partly_assigned():
    """Rule 1's point: whatever the waiters, after a grant pass at most one of those that held
    memory or got some is still short of its limit (the one the memory ran out on)."""
    r = rng(5)
    for policy, most in (("bfa", 1), ("bf", 2)):
        seen = 0
        for _ in range(500):
            ws = []
            for i in range(r.randrange(1, 7)):   # x0 may hold part of its limit, the rest nothing
                limit = r.randrange(2, 4 * GiB)
                ws.append(w(f"x{i}", r.randrange(10), r.uniform(0, 100),
                            r.randrange(1, limit) if i == 0 else limit, 1, limit=limit))
            assigned = {x.id: x.assigned for x in ws}
            for g in schedule(policy, ws, r.randrange(1, 4 * GiB), 100, rng(), r.choice([0, 30, 1e9]),
                              capacity=ROOMY):
                assigned[g.id] += g.amount
            seen = max(seen, sum(0 < assigned[x.id] < x.limit for x in ws))
        assert seen == most, policy   # bf: a holder left behind plus a new slice


# ---- schedule ----

def test_schedule_multi_grant_exact():
    free = 4 * GiB
    # fifo: w1 2 GiB (need 1: resume), free 2 -> w2 1 GiB (need 1: resume), free 1 ->
    # w3 1 GiB of its 1.25 missing (need 1.25: paused), free 0 -> w4 nothing.
    assert schedule("fifo", FOUR, free, NOW, rng()) == [
        Grant("w1", 2 * GiB, True), Grant("w2", 1 * GiB, True), Grant("w3", 1 * GiB, False)]
    # bf: fits <= 4: w1 (2) largest, free 2 -> w3 (1.25), free 0.75 -> w4 (0.5), free 0.25 ->
    # none fits, least missing w2 (1) gets 0.25 of need 1: paused.
    assert schedule("bf", FOUR, free, NOW, rng()) == [
        Grant("w1", 2 * GiB, True), Grant("w3", 5 * GiB // 4, True),
        Grant("w4", GiB // 2, True), Grant("w2", GiB // 4, False)]
    # ru: w4 (55) 0.5, w3 (45) 1.25, w1 (40) 2 -> free 0.25 -> w2 0.25, paused.
    assert schedule("ru", FOUR, free, NOW, rng()) == [
        Grant("w4", GiB // 2, True), Grant("w3", 5 * GiB // 4, True),
        Grant("w1", 2 * GiB, True), Grant("w2", GiB // 4, False)]
    # bfa: holders in created order: w2 (1, resume), free 3 -> w3 (1.25, resume), free 1.75
    # -> w4 (0.5, resume), free 1.25 -> w1 (holds nothing, 20 s < 180: bf; misses 2) 1.25 of
    # its 2, need 1: resumes.
    assert schedule("bfa", FOUR, free, NOW, rng()) == [
        Grant("w2", 1 * GiB, True), Grant("w3", 5 * GiB // 4, True),
        Grant("w4", GiB // 2, True), Grant("w1", 5 * GiB // 4, True)]


def test_schedule_free_left_over_when_all_served():
    # Everyone reaches its limit and 1 GiB stays free.
    ws = [w("a", 1, 0, 1 * GiB, GiB // 2), w("b", 2, 0, 2 * GiB, 2 * GiB)]
    assert schedule("fifo", ws, 4 * GiB, 0, rng()) == [
        Grant("a", 1 * GiB, True), Grant("b", 2 * GiB, True)]


def test_schedule_invariants_random():
    r = rng(99)
    for _ in range(300):
        ws = [w(f"x{i}", r.randrange(10), r.uniform(0, 100), r.randrange(0, 3 * GiB),
                r.randrange(1, 1 * GiB)) for i in range(r.randrange(0, 7))]
        before = copy.deepcopy(ws)
        free = r.randrange(0, 6 * GiB)
        by_id = {x.id: x for x in ws}
        for policy in NAMES:
            grants = schedule(policy, ws, free, 100, rng(r.random()), capacity=ROOMY)
            assert sum(g.amount for g in grants) <= free
            assert len({g.id for g in grants}) == len(grants)
            for g in grants:
                x = by_id[g.id]
                assert 0 < g.amount <= x.missing
                assert g.resume == (x.need <= g.amount)
            helpable = [x for x in ws if x.missing > 0]
            # The loop stops only when memory runs out or every helpable waiter was served.
            assert sum(g.amount for g in grants) == free or len(grants) == len(helpable)
        assert ws == before


def test_schedule_does_not_mutate_inputs():
    ws = list(FOUR)
    ws_t = tuple(FOUR)
    for policy in NAMES:
        schedule(policy, ws, 4 * GiB, NOW, rng())
        schedule(policy, ws_t, 4 * GiB, NOW, rng())
    assert ws == FOUR and ws_t == tuple(FOUR)
    assert [x.assigned for x in ws] == [0, 1 * GiB, 3 * GiB // 4, 3 * GiB // 2]


def test_at_limit_waiter_skipped():
    full = Waiter("full", created=0, suspended_at=99, limit=1 * GiB, assigned=1 * GiB,
                  used=1 * GiB, request=MiB)  # over its limit: the enforcer's case
    other = w("other", 5, 0, GiB // 2, 1)
    for policy in NAMES:
        assert pick(policy, [full, other], 1 * GiB, 100, rng()) == other
        assert schedule(policy, [full, other], 1 * GiB, 100, rng()) == [
            Grant("other", GiB // 2, True)]
        assert pick(policy, [full], 1 * GiB, 100, rng()) is None
        assert schedule(policy, [full], 1 * GiB, 100, rng()) == []


@pytest.mark.parametrize("policy", NAMES)
def test_nothing_to_give(policy):
    assert schedule(policy, FOUR, 0, NOW, rng()) == []
    assert schedule(policy, FOUR, -5, NOW, rng()) == []
    assert pick(policy, FOUR, 0, NOW, rng()) is None
    assert schedule(policy, [], GiB, NOW, rng()) == []
    assert pick(policy, [], GiB, NOW, rng()) is None


def test_assign_new():
    assert assign_new(2 * GiB, 5 * GiB) == 2 * GiB
    assert assign_new(2 * GiB, 1 * GiB) == 1 * GiB
    assert assign_new(2 * GiB, 2 * GiB) == 2 * GiB
    assert assign_new(2 * GiB, 0) == 0
    assert assign_new(2 * GiB, -1) == 0  # over-committed capacity never yields a negative


def test_policies_registry():
    assert set(POLICIES) == set(NAMES)


@pytest.mark.parametrize("call", [pick, schedule])
def test_unknown_policy(call):
    with pytest.raises(ValueError) as e:
        call("lifo", FOUR, GiB, NOW, rng())
    msg = str(e.value)
    assert "'lifo'" in msg
    assert all(n in msg for n in NAMES)
    with pytest.raises(ValueError, match="lifo"):  # even with nothing to schedule
        call("lifo", [], 0, NOW, rng())


def test_negative_max_wait_rejected():
    with pytest.raises(ValueError, match="max_wait"):
        schedule("bfa", FOUR, GiB, NOW, rng(), max_wait=-1)


def test_cross_policy_order_independence():
    # Deterministic policies give the same schedule whatever order the waiters come in.
    for perm in itertools.permutations(FOUR):
        for policy in ("fifo", "bf", "ru", "bfa"):
            assert schedule(policy, list(perm), 4 * GiB, NOW, rng()) == \
                schedule(policy, FOUR, 4 * GiB, NOW, rng())
