"""enforcer/swap/idle.py: when a process is idle, whom to swap out for a waiter, and which side of
a deadlock goes out (docs/SCHEDULING.md, "A deadlock swapped out"), as pure functions."""
from convgpu.enforcer.swap.idle import Holder, breaker, observe, victims

GiB = 1 << 30


def test_quiet_is_no_driver_call_no_cpu_and_no_gpu_use_for_the_whole_time():
    a = observe(None, calls=10, cpu_ticks=500, busy_gpu=False, now=100.0)
    assert a.quiet_since == 100.0
    a = observe(a, 10, 500, False, 130.0)                   # nothing moved for 30 s
    assert a.quiet_since == 100.0
    b = observe(a, 11, 500, False, 131.0)                   # one allocation
    assert b.quiet_since == 131.0
    c = observe(a, 10, 501, False, 131.0)                   # 10 ms of CPU in 1 s: 1 %, at the line
    assert c.quiet_since == 100.0
    d = observe(a, 10, 503, False, 131.0)                   # 30 ms of CPU in 1 s: it works
    assert d.quiet_since == 131.0
    e = observe(a, 10, 500, True, 131.0)                    # NVML saw its SMs busy
    assert e.quiet_since == 131.0


def test_victims_are_idle_longest_first_until_the_need_is_covered_and_none_if_it_cannot_be():
    hs = [Holder(1, "a", 3 * GiB, 50.0), Holder(2, "b", 2 * GiB, 400.0), Holder(3, "c", 4 * GiB, 5.0),
          Holder(4, "d", 8 * GiB, 900.0, why_not="container d is marked not swappable")]
    assert [h.pid for h in victims(hs, 2 * GiB, 30.0)] == [2]           # idlest first, d never
    assert [h.pid for h in victims(hs, 4 * GiB, 30.0)] == [2, 1]
    assert victims(hs, 6 * GiB, 30.0) == []                             # c is not idle long enough
    assert [h.pid for h in victims(hs, 6 * GiB, 1.0)] == [2, 1, 3]


def test_a_deadlock_swaps_the_container_that_frees_another_waiters_need_with_the_least_footprint():
    hs = [Holder(1, "a", 3 * GiB, 0.0), Holder(2, "a", 1 * GiB, 0.0),     # a: 4 GiB
          Holder(3, "b", 2 * GiB, 0.0),                                   # b: 2 GiB
          Holder(4, "c", 1 * GiB, 0.0)]                                   # c: 1 GiB
    # a lacks 1 GiB: c's 1 GiB covers it, the least footprint of any side that helps
    assert [h.pid for h in breaker(hs, {"a": GiB, "b": 3 * GiB, "c": 2 * GiB})] == [4]
    # a lacks 1.5 GiB: c's 1 GiB helps nobody (b lacks 3, a 1.5); b's 2 GiB covers a, with less than a's 4
    assert [h.pid for h in breaker(hs, {"a": 3 * GiB // 2, "b": 3 * GiB, "c": 2 * GiB})] == [3]
    # nobody's processes cover another's need: none
    assert breaker(hs, {"a": 8 * GiB, "b": 8 * GiB, "c": 8 * GiB}) == []
    # a side with a process that cannot go (held whole) is not chosen
    hs2 = [*hs[:2], Holder(3, "b", 2 * GiB, 0.0, why_not="stopped whole"), hs[3]]
    assert [h.pid for h in breaker(hs2, {"a": 3 * GiB // 2, "b": 3 * GiB, "c": 2 * GiB})] == [1, 2]
