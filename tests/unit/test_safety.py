"""The banker's check that keeps every policy out of deadlock (enforcer/policies.py: finishers,
safe, safe_assignment, and their use in schedule and assign_new), on small states worked out by
hand. Capacity 4 GiB and 1 GiB contexts throughout, so the numbers stay readable."""
import random

import pytest

from convgpu.enforcer.policies import (Claim, Grant, Waiter, assign_new, finishers, safe,
                                       safe_assignment, schedule)

GiB = 1 << 30
CAP = 4 * GiB


def rng():
    return random.Random(0)


# ---- the check itself ----

def test_a_safe_state_and_its_order():
    # R runs, assigned 2 of its limit 3 (it may use all 2 without asking). B waits holding its
    # 1 GiB context, limit 3. Free: 1. R misses 1 -> it can finish, then 3 are free; B misses 2.
    state = [Claim("b", 3 * GiB, 1 * GiB), Claim("r", 3 * GiB, 2 * GiB)]
    assert finishers(state, CAP) == ["r", "b"]
    assert safe(state, CAP)


def test_an_unsafe_state():
    # The same, but B was resumed with 1.5 GiB: free 0.5, R misses 1, B 1.5: nobody can go on,
    # and if both now ask for more, nothing will ever come back.
    state = [Claim("b", 3 * GiB, 3 * GiB // 2), Claim("r", 3 * GiB, 2 * GiB)]
    assert finishers(state, CAP) == []
    assert not safe(state, CAP)


def test_order_is_by_what_is_missing_and_frees_add_up():
    # free 1: a (misses 1) first -> 2 free; c (misses 2) -> 3 free; b (misses 3) last.
    state = [Claim("b", 3 * GiB, 0), Claim("c", 3 * GiB, 1 * GiB), Claim("a", 3 * GiB, 2 * GiB)]
    assert finishers(state, CAP) == ["a", "c", "b"]
    # one byte more held by c: a can still go first, but then only 2 GiB - 1 byte is free
    state[1] = Claim("c", 3 * GiB, 1 * GiB + 1)
    assert finishers(state, CAP) == []   # free 1 - 1 byte: not even a fits any more


def test_a_stuck_container_keeps_what_it_holds():
    # x is over its limit (waits for an operator): it never finishes; its 3 GiB never come back.
    state = [Claim("x", 2 * GiB, 3 * GiB, stuck=True), Claim("z", 1 * GiB, 0), Claim("y", 2 * GiB, 0)]
    assert finishers(state, CAP) == ["z"]   # y (limit 2) can never have 2 GiB beside x
    assert not safe(state, CAP)


# ---- the largest safe assignment ----

def test_safe_assignment_cuts_to_what_the_others_still_need():
    # R runs, holds 1 of its limit 2. W (limit 4, nothing held) would run with A: then 3 - A are
    # free, and R (missing 1) can finish only if A <= 2; after R, W's own 4 - A always fit.
    r = Claim("r", 2 * GiB, 1 * GiB)
    w = Claim("w", 4 * GiB, 0)
    assert safe_assignment(w, [r], CAP, 1 * GiB, 3 * GiB) == 2 * GiB
    assert safe_assignment(w, [r], CAP, 1 * GiB, 2 * GiB) == 2 * GiB      # the top itself is safe
    assert safe_assignment(w, [r], CAP, 1 * GiB, 3 * GiB // 2) == 3 * GiB // 2
    assert safe_assignment(w, [r], CAP, 2 * GiB + 1, 3 * GiB) is None    # it needs more than is safe


def test_a_state_unsafe_from_outside_leaves_the_moves_that_make_it_no_worse():
    # x is stuck over its limit with 3 GiB: y (limit 2) can never finish, whatever anyone gets.
    # z (limit 1) may still run on the 1 GiB left: nobody who could finish before is hurt.
    x = Claim("x", 2 * GiB, 3 * GiB, stuck=True)
    y = Claim("y", 2 * GiB, 0)
    z = Claim("z", 1 * GiB, 0)
    assert safe_assignment(z, [x, y], CAP, 1, 1 * GiB) == 1 * GiB
    assert safe_assignment(y, [x, z], CAP, 1, 1 * GiB) is None   # y itself can never finish


# ---- what the policies do with it ----
# R ran and exited; 2 GiB are free. B and C wait, each holding its 1 GiB context (limit 3:
# each misses 2). D, the newest, waits at its first context (limit 3, holds nothing, needs 1).
B = Waiter("b", created=1, suspended_at=5, limit=3 * GiB, assigned=1 * GiB, used=3 * GiB, request=0,
           held=1 * GiB)
C = Waiter("c", created=2, suspended_at=6, limit=3 * GiB, assigned=1 * GiB, used=3 * GiB, request=0,
           held=1 * GiB)
D = Waiter("d", created=3, suspended_at=7, limit=3 * GiB, assigned=0, used=1 * GiB, request=0, held=0)


def test_ru_without_the_check_would_resume_d_into_a_deadlock():
    # The paper's ru: D (suspended last) gets min(3, 2) = 2 GiB, enough for its context: it
    # resumes and then may use 2 GiB. Held then: B 1, C 1, D 2: nothing free, every one misses
    # 1 or 2: unsafe. (D makes its context and stalls at its allocation; the reclaim gives back
    # D's unused 1 GiB, and each of the three waits for 2 GiB with 1 free: the deadlock that
    # docs/SCHEDULING.md counted in 39 % of 10-container runs with 519 MiB contexts.)
    assert schedule("ru", [B, C, D], 2 * GiB, 10, rng(), capacity=64 * GiB) == [Grant("d", 2 * GiB, True)]
    assert not safe([Claim("b", 3 * GiB, 1 * GiB), Claim("c", 3 * GiB, 1 * GiB),
                     Claim("d", 3 * GiB, 2 * GiB)], CAP)
    # With the check: D has no safe move (running on A, it leaves 2 - A free and B or C need 2;
    # it would have to finish first, and it misses 3 - A with 2 - A free), so ru's next choice,
    # C (suspended after B), gets its 2 GiB and runs to its limit; B and D follow when C exits.
    assert schedule("ru", [B, C, D], 2 * GiB, 10, rng(), capacity=CAP) == [Grant("c", 2 * GiB, True)]
    assert safe([Claim("b", 3 * GiB, 1 * GiB), Claim("c", 3 * GiB, 3 * GiB), Claim("d", 3 * GiB, 0)], CAP)


@pytest.mark.parametrize("seed", range(20))
def test_rand_picks_only_among_safe_moves(seed):
    g = schedule("rand", [B, C, D], 2 * GiB, 10, random.Random(seed), capacity=CAP)
    assert g in ([Grant("b", 2 * GiB, True)], [Grant("c", 2 * GiB, True)])


def test_a_grant_is_cut_to_the_largest_safe_amount():
    # R runs holding 1 of its limit 2; W (limit 4) waits at its 1 GiB context; 3 GiB are free.
    # All 3 would leave R (missing 1) nothing: W resumes with 2 (as computed above).
    r = Claim("r", 2 * GiB, 1 * GiB)
    w = Waiter("w", created=1, suspended_at=1, limit=4 * GiB, assigned=0, used=1 * GiB, request=0, held=0)
    assert schedule("fifo", [w], 3 * GiB, 2, rng(), others=[r], capacity=CAP) == [Grant("w", 2 * GiB, True)]
    # the pass after a reclaim is held to the same
    assert schedule("fifo", [w], 3 * GiB, 2, rng(), fit_only=True, others=[r], capacity=CAP) == [
        Grant("w", 2 * GiB, True)]


def test_a_partial_grant_that_resumes_nobody_is_not_checked():
    # W needs 3 GiB to resume and 2 are free: the paper's partial grant, kept while it waits.
    # A waiter's unused assignment can be taken back (reclaim), so the check counts only the
    # 1 GiB it holds: the move changes nothing there.
    w = Waiter("w", created=1, suspended_at=1, limit=4 * GiB, assigned=1 * GiB, used=4 * GiB, request=0,
               held=1 * GiB)
    r = Claim("r", 1 * GiB, 1 * GiB)
    assert schedule("ru", [w], 2 * GiB, 2, rng(), others=[r], capacity=CAP) == [Grant("w", 2 * GiB, False)]


def test_placement_is_cut_or_waits():
    # R runs with 1 of its limit 1; B and C wait with their contexts (limit 3 each); 1 GiB is
    # unassigned. D (limit 3) arrives: the paper gives it that 1 GiB, enough for its context,
    # and then R's exit frees 1 while B, C and D each miss 2: unsafe. With the check D gets 0
    # and waits, holding nothing.
    others = [Claim("r", 1 * GiB, 1 * GiB), Claim("b", 3 * GiB, 1 * GiB), Claim("c", 3 * GiB, 1 * GiB)]
    assert assign_new(3 * GiB, 1 * GiB) == 1 * GiB
    assert assign_new(3 * GiB, 1 * GiB, others, CAP, demand=1 * GiB) == 0
    # alone beside R (holding 1 of its limit 2), D gets what leaves R its last 1 GiB: 2 of 3.
    assert assign_new(4 * GiB, 3 * GiB, [Claim("r", 2 * GiB, 1 * GiB)], CAP, demand=1 * GiB) == 2 * GiB
    # and its limit where that is safe
    assert assign_new(2 * GiB, 3 * GiB, [Claim("r", 2 * GiB, 1 * GiB)], CAP, demand=1 * GiB) == 2 * GiB
    # placed below its demand it waits anyway: the slice is unused, so it stays (reclaimable)
    assert assign_new(3 * GiB, GiB // 2, others[:1], CAP, demand=1 * GiB) == GiB // 2
