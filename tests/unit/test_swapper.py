"""The swapper's state machine (enforcer/swap/swapper.py) without a kernel or a driver: real
books over fake BPF counters, a fake agent that answers as told, a recording BpfMaps. What a
swap moves in the books (the credit, the assignment, the wait for the footprint), and that every
failure goes back to the last safe state."""
import json
import os
from types import SimpleNamespace

from convgpu.enforcer.books import Books, Box
from convgpu.enforcer.swap.client import Result
from convgpu.enforcer.swap.swapper import MARGIN, Settings, Swapper
from convgpu.enforcer.tenants.containers import Container

MiB, GiB = 1 << 20, 1 << 30
CTX = 500 * MiB
P = os.getpid()   # the swapped process: a live one, whose start time a successor checks
KILLED = []       # the pids the swapper killed (never pytest itself)


class Agent:
    def __init__(self):
        self.asked, self.off, self.driver = [], "", "/lib/libcuda.so.1"
        self._out = []

    def submit(self, op, pid, deadline_s, timeout_ms=0):
        self.asked.append((op, pid))

    def answer(self, op, pid, rc=0, state=-1):
        self._out.append(Result(op, pid, rc, state))

    def results(self):
        out, self._out = self._out, []
        return out

    def pid(self):
        return None


class Maps:
    def __init__(self):
        self.swapped, self.assigns = set(), []

    def set_swapped(self, pid, on):
        (self.swapped.add if on else self.swapped.discard)(pid)

    def write_assign(self, box, dev):
        self.assigns.append((box.name, dev, box.assigned[dev]))


class Tracer:
    touch_on = False

    def touch(self, on):
        self.touch_on = on

    def usage(self):
        return []


def setup(tmp_path, free=8 * GiB, settings=Settings()):
    state = {}
    books = Books({0: 8 * GiB}, {0: 8 * GiB}, lambda box, dev: state.get((box.key, dev)), lambda dev: CTX,
                  lambda box, dev: box.limit)
    box = Box(1, Container("cgroup", "/a", "/a"), "a", 0.0, 4 * GiB, "test", {P}, assigned={0: 4 * GiB})
    books.boxes[box.container.id] = books.by_key[1] = box
    books.pid_box[P] = box
    state[(1, 0)] = SimpleNamespace(used=3 * GiB, contexts=1, reserved=0, tearing=0)
    sampler = SimpleNamespace(raw={(P, 0): 3 * GiB + CTX}, used={0: 8 * GiB - free}, seq=1)
    agent, maps, tracer, changed = Agent(), Maps(), Tracer(), []
    sw = Swapper(books, maps, tracer, agent, settings,
                 lambda b, d: {P: (3 * GiB + CTX, CTX)}, lambda pid: False, lambda: sampler, lambda d: 8 * GiB,
                 lambda: changed.append(1), KILLED.append, str(tmp_path / "swap.json"))
    return sw, books, box, agent, maps, tracer, sampler


def test_out_then_its_next_call_then_back(tmp_path):
    sw, books, box, agent, maps, tracer, sampler = setup(tmp_path)
    assert books.held(box, 0) == 3 * GiB + CTX
    assert sw.out(P, "by hand") == ""
    assert agent.asked == [("lock", P)] and tracer.touch_on          # heard once locked
    assert sw.procs[P].state == "locking" and books.held(box, 0) == 3 * GiB + CTX   # nothing moved yet
    agent.answer("lock", P)
    sw.step(1.0)
    assert agent.asked[-1] == ("checkpoint", P) and sw.procs[P].state == "checkpointing"
    kept = json.load(open(tmp_path / "swap.json"))["procs"][str(P)]    # kept before the step goes out
    assert kept["state"] == "checkpointing" and kept["bytes"] == {"0": 3 * GiB + CTX}
    agent.answer("checkpoint", P, state=2)
    sw.step(2.0)
    s = sw.procs[P]
    assert s.state == "out" and s.credit == {0: 3 * GiB + CTX} and maps.swapped == {P}
    assert books.held(box, 0) == 0 and books.swapped == {"/a": {0: 3 * GiB + CTX}}
    assert box.assigned[0] == 4 * GiB - (3 * GiB + CTX)               # its room may go to others
    assert sw.status(box, 0)["swapped"] == 3 * GiB + CTX
    # its next call: a wait for its whole footprint, as any wait
    sw.want(P, "its next driver call")
    w = box.waiting[0]
    assert [(a.pid, a.size, a.swapin, a.need) for a in w.asks.values()] == [(P, 3 * GiB + CTX, True, 3 * GiB + CTX)]
    assert books.demand(box, 0) == 3 * GiB + CTX
    # granted (the Actuator hands the swapin ask over): the room is held in the books, restore goes
    box.assigned[0] = 4 * GiB
    sw.resume(box, 0, w.asks[-P])
    assert agent.asked[-1] == ("restore", P) and books.held(box, 0) == 3 * GiB + CTX and books.swapped == {}
    agent.answer("restore", P, state=1)
    sw.step(3.0)
    assert agent.asked[-1] == ("unlock", P)
    agent.answer("unlock", P, state=0)
    sw.step(4.0)
    assert sw.procs == {} and maps.swapped == set() and not tracer.touch_on and sw.restores == 1
    assert json.load(open(tmp_path / "swap.json"))["procs"] == {}


def test_a_lock_or_checkpoint_that_fails_leaves_it_running(tmp_path):
    sw, books, box, agent, maps, tracer, _ = setup(tmp_path)
    sw.out(P, "by hand")
    agent.answer("lock", P, rc=None)            # no answer in time: the agent was killed
    sw.step(1.0)
    assert agent.asked[-1] == ("unlock", P) and sw.procs == {} and books.held(box, 0) == 3 * GiB + CTX
    sw.out(P, "by hand")
    agent.answer("lock", P)
    sw.step(2.0)
    agent.answer("checkpoint", P, rc=999)
    sw.step(3.0)
    assert agent.asked[-1] == ("unlock", P) and sw.procs == {} and books.swapped == {} and not maps.swapped


def test_a_restore_is_never_started_without_the_room_nvml_shows(tmp_path):
    sw, books, box, agent, maps, tracer, sampler = setup(tmp_path, free=8 * GiB)
    sw.out(P, "by hand")
    agent.answer("lock", P)
    sw.step(1.0)
    agent.answer("checkpoint", P, state=2)
    sw.step(2.0)
    sw.want(P, "by hand")
    sampler.used = {0: 8 * GiB - (3 * GiB + CTX + MARGIN - 1)}    # someone else holds the room
    sw.resume(box, 0, box.waiting.pop(0).asks[-P])         # granted: the Actuator took the wait
    assert agent.asked[-1] == ("checkpoint", P) and sw.procs[P].state == "out"   # no restore asked
    assert books.swapped == {"/a": {0: 3 * GiB + CTX}} and 0 not in box.waiting
    sw.step(10.0)                                               # the same NVML sample: nothing
    assert 0 not in box.waiting
    sampler.seq += 1                                            # a new one: it waits again
    sw.step(12.0)
    assert box.waiting[0].asks[-P].swapin and agent.asked[-1] == ("checkpoint", P)


def test_a_restore_with_no_answer_goes_back_out_and_one_the_driver_refused_is_killed(tmp_path):
    """Driver 580 (docs/gpu-runs/2026-12-06b): a restore that lacked the room answered 2 and left
    the process CHECKPOINTED (2); the next restore answered 304, still 2, and unlock 401: it never
    runs again. So any refusal is final: the process is killed (its job fails, not hangs); only
    a restore that got no answer is tried again."""
    sw, books, box, agent, *_ = setup(tmp_path)
    KILLED.clear()
    sw.out(P, "by hand")
    agent.answer("lock", P)
    sw.step(1.0)
    agent.answer("checkpoint", P, state=2)
    sw.step(2.0)
    sw.want(P, "by hand")
    sw.resume(box, 0, box.waiting.pop(0).asks[-P])
    agent.answer("restore", P, rc=None)                        # the agent's deadline: no answer
    sw.step(3.0)
    assert sw.procs[P].state == "out" and not sw.procs[P].asked and books.swapped == {"/a": {0: 3 * GiB + CTX}}
    assert KILLED == []
    sw.want(P, "retry")
    sw.resume(box, 0, box.waiting.pop(0).asks[-P])
    agent.answer("restore", P, rc=2, state=2)                  # out of memory: "still checkpointed"
    sw.step(4.0)
    assert sw.procs[P].state == "failed" and KILLED == [P], (sw.procs[P], KILLED)
    assert sw.status(box, 0)["swaps"][0]["state"] == "failed"


def test_what_may_not_go_says_why(tmp_path):
    sw, books, box, agent, *_ = setup(tmp_path, settings=Settings(never=("a*",)))
    assert sw.out(P, "by hand") == "container a is marked not swappable"
    assert sw.out(99, "by hand") == "pid 99 is not a CUDA process convgpu placed"
    sw2, books2, box2, *_ = setup(tmp_path, settings=Settings(budget=GiB))
    assert sw2.out(P, "by hand").startswith("the swap budget 1.0 GiB would be passed")
    sw3, _, box3, agent3, *_ = setup(tmp_path)
    agent3.off = "the driver has no checkpoint API"
    assert sw3.out(P, "x") == "swap is off: the driver has no checkpoint API"


def test_a_successor_takes_back_what_was_out_and_unlocks_what_was_in_between(tmp_path):
    sw, books, box, agent, maps, tracer, _ = setup(tmp_path)
    sw.out(P, "by hand")
    agent.answer("lock", P)
    sw.step(1.0)
    agent.answer("checkpoint", P, state=2)
    sw.step(2.0)
    start = sw.procs[P].start
    nxt, books2, box2, agent2, maps2, tracer2, _ = setup(tmp_path)
    for s in json.load(open(tmp_path / "swap.json"))["procs"].values():
        assert s["start"] == start
    nxt.load()
    assert nxt.procs[P].state == "out" and books2.swapped == {"/a": {0: 3 * GiB + CTX}} and maps2.swapped == {P}
    assert tracer2.touch_on and agent2.asked == []             # nothing asked of the driver: still out
    # one that was in between (locking, checkpointing, restoring): where the driver left it decides
    rec = json.load(open(tmp_path / "swap.json"))
    rec["procs"][str(P)]["state"] = "checkpointing"
    json.dump(rec, open(tmp_path / "swap.json", "w"))
    third, books3, _, agent3, *_ = setup(tmp_path)
    third.load()
    assert agent3.asked == [("state", P)] and third.procs[P].state == "checking" and books3.swapped == {}
    agent3.answer("state", P, state=1)                       # locked, not checkpointed: unlocked
    third.step(1.0)
    assert agent3.asked[-1] == ("unlock", P) and third.procs[P].state == "unlocking"
    # a pid now another process's (its start time differs) is not taken
    rec["procs"][str(P)]["start"] += 1
    json.dump(rec, open(tmp_path / "swap.json", "w"))
    fourth, *_ = setup(tmp_path)
    fourth.load()
    assert fourth.procs == {}
