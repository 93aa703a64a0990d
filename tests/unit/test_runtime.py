"""The Runtime part (enforcer/runtime.py) built alone: real rules, books and decisions file (in a
temporary state dir, cgroup identities faked), fakes of the decider, the shim's credit, the
map writer and Admission. No Enforcer, no kernel, no root."""
import logging

import pytest

from convgpu.enforcer.books import Books, Box, Wait, Ask
from convgpu.enforcer.runtime import Runtime
from convgpu.enforcer.tenants import decisionfile, durable
from convgpu.enforcer.tenants.config import Rule
from convgpu.enforcer.tenants.containers import Container
from convgpu.enforcer.tenants.limits import LimitRules
from convgpu.errors import ConvgpuError

MiB, GiB = 1 << 20, 1 << 30
CGROUPS = {"/jobs/a": 101, "/jobs/run": 202}   # the cgroups that exist, and their ids


class Decider:
    def __init__(self, over_limit="kill"):
        self.policy, self.max_wait, self.over_limit, self.schedules = "fifo", 60.0, over_limit, 0

    def schedule(self):
        self.schedules += 1


class Calls(list):
    def __call__(self, *args):
        self.append(args)


def part(tmp_path, reload=None, over_limit="kill"):
    rules = LimitRules({}, 2 * GiB)
    store = durable.Store(str(tmp_path), identity=CGROUPS.get).open(wait=0)
    books = Books({0: 8 * GiB}, {0: 8 * GiB}, lambda box, dev: None, lambda dev: 0, lambda box, dev: box.limit)
    revoke, written, control, decider = Calls(), Calls(), Calls(), Decider(over_limit)
    rt = Runtime(rules, store, books, decider, revoke, written, control, reload)
    rt.decided()   # as at start
    return rt, books, decider, revoke, written, control


def box(books, key, name, cgroup, limit, source, assigned=GiB):
    b = Box(key, Container("cgroup", cgroup, cgroup), name, 0.0, limit, source, {key * 10}, assigned={0: assigned})
    books.boxes[b.container.id] = books.by_key[key] = b
    return b


def test_limit_set_is_kept_before_it_applies_and_a_waiter_over_the_old_limit_may_fit(tmp_path):
    rt, books, decider, revoke, written, _ = part(tmp_path)
    a = box(books, 1, "a", "/jobs/a", 2 * GiB, "default", assigned=2 * GiB)
    a.waiting[0] = Wait(0.0, {10}, over_limit=True, asks={10: Ask(10, 10, 3 * GiB, 0.0, over_limit=True, said=True)})
    assert rt.set_limit("a", 4 * GiB) == ("a", 4 * GiB)
    assert durable.Store(str(tmp_path), identity=CGROUPS.get).open(wait=0).value.limits["/jobs/a"] == \
        decisionfile.LimitSet(4 * GiB, "/jobs/a", 101)      # on disk before it applied
    assert rt.rules.runtime == {"/jobs/a": 4 * GiB} and (a.limit, a.source) == (4 * GiB, "convgpu limit set")
    w = a.waiting[0]
    assert not w.over_limit and (w.asks[10].over_limit, w.asks[10].said) == (False, False)
    assert revoke == [(a, 0)] and written == [(a, 0)] and decider.schedules == 1
    assert rt.set_limit("a", 4 * GiB) == ("a", 4 * GiB) and decider.schedules == 1   # the same: nothing to do
    assert rt.set_limit("a", 64 * GiB) == ("a", 8 * GiB)   # capped at the capacity
    with pytest.raises(KeyError):
        rt.set_limit("nobody", GiB)


def test_a_run_is_registered_by_name_before_its_first_call_and_its_limit_set_by_that_name(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="convgpu")
    rt, books, decider, _, written, _ = part(tmp_path)
    with pytest.raises(ConvgpuError):
        rt.register_run("/jobs/none", GiB, "ghost")     # no such cgroup: refused, nothing kept
    rt.register_run("/jobs/run", GiB, "trainer")
    assert rt.name_of("/jobs/run", "x") == "trainer" and rt.rules.runs == {"/jobs/run": GiB}
    assert rt.registered() == [{"id": "/jobs/run", "name": "trainer", "cgroup": "/jobs/run", "limit": GiB,
                                "source": "convgpu run --limit", "what": "registered"}]
    assert rt.set_limit("trainer", 3 * GiB) == ("trainer", 3 * GiB)
    assert rt.registered()[0]["limit"] == 3 * GiB and written == [] and decider.schedules == 0
    box(books, 2, "trainer", "/jobs/run", 3 * GiB, "convgpu limit set")
    assert rt.registered() == []                         # placed: a container like any other


def test_pods_and_claims_the_enforcer_holds_limits_for_are_listed_until_a_process_of_them_is_placed(tmp_path):
    """status lists what has a limit and no CUDA call yet: pods (the agent's pod-limits, by
    container id or pod uid) and DRA claims (by the pods and containers they are for), not only
    `convgpu run` jobs. Names as the tenant gave them: the views print them as text."""
    from convgpu.enforcer.tenants.claims import ClaimShare
    from convgpu.enforcer.tenants.limits import PodLimit
    rt, books, *_ = part(tmp_path)
    cid = "c" * 64
    v = rt.durable.value.with_pods({cid: PodLimit(3 * GiB, "pod ml/train: 3 units", job="ml/Job/[/x]/main"),
                                    "uid-2": PodLimit(GiB, "pod ml/idle: 1 unit")})
    rt.durable.commit(v.with_claims({"claim-1": ClaimShare("ml/small", ("uid-3",), (("gpu0", 20 * GiB),))}), "test")
    assert rt.registered() == [
        {"id": cid, "name": "ml/Job/[/x]/main", "cgroup": "", "limit": 3 * GiB, "source": "pod ml/train: 3 units",
         "what": "pod"},
        {"id": "uid-2", "name": "uid-2", "cgroup": "", "limit": GiB, "source": "pod ml/idle: 1 unit", "what": "pod"},
        {"id": "claim-1", "name": "ml/small", "cgroup": "", "limit": 20 * GiB, "source": "DRA claim", "what": "claim"}]
    b = Box(1, Container("docker", cid, "/docker/" + cid), "main", 0.0, 3 * GiB, "pod", {10}, assigned={0: GiB})
    books.boxes[cid] = books.by_key[1] = b          # its first CUDA call: a container like any other
    c = Box(2, Container("kubernetes", "uid-3", "/kubepods/poduid-3", pod="uid-3"), "pod-uid-3", 0.0, 20 * GiB,
            "claim", {20}, assigned={0: GiB})
    books.boxes["uid-3"] = books.by_key[2] = c      # a process of the claim's pod
    assert [r["id"] for r in rt.registered()] == ["uid-2"]


def test_unreadable_decisions_hold_everyone_suspend_kill_and_a_reload_reads_them_again(tmp_path):
    (tmp_path / durable.FILE).write_bytes(b"not json")
    rt, books, decider, _, _, control = part(tmp_path, over_limit="kill")
    assert rt.durable.error and decider.over_limit == "stall"
    assert rt.rules.limit_for(Container("cgroup", "/jobs/a", "/jobs/a"), "a", None)[0] == 0   # held
    a = box(books, 1, "a", "/jobs/a", 0, "unknown: the run-time decisions could not be read")
    with pytest.raises(durable.NotKept):
        rt.set_limit("a", GiB)                          # nothing decided while it is unreadable
    assert not rt.reload()                              # still unreadable (and no config file)
    (tmp_path / durable.FILE).unlink()                  # moved aside
    assert rt.reload() and decider.over_limit == "kill" and control == [(True,)]
    assert (a.limit, a.source) == (2 * GiB, "default") and decider.schedules == 1


def test_a_reload_changes_the_rules_in_place_and_the_containers_whose_limit_came_from_them(tmp_path):
    new = LimitRules({}, 3 * GiB, [Rule("cgroup", "/jobs/b*", GiB)])
    rt, books, decider, _, written, _ = part(tmp_path, reload=lambda: (new, {"policy": "bf", "max_wait": 5.0}))
    rules = rt.rules
    a = box(books, 1, "a", "/jobs/a", 2 * GiB, "default")
    b = box(books, 2, "b", "/jobs/b1", 2 * GiB, "default")
    rt.set_limit("a", GiB)                               # run-time decisions outlive a reload
    written.clear()
    assert rt.reload()
    assert rt.rules is rules and rules.default == 3 * GiB and rules.runtime == {"/jobs/a": GiB}
    assert (decider.policy, decider.max_wait) == ("bf", 5.0)
    assert (a.limit, a.source) == (GiB, "convgpu limit set")
    assert (b.limit, b.source) == (GiB, new.rules[0].source) and written == [(b, 0)]
    assert rt.relimit() == 0                             # worked out again: nothing changes


def test_a_name_two_containers_share_is_an_error_listing_their_ids(tmp_path):
    """Issue 52: two `convgpu run --name same` jobs, and `limit set same` changed the first
    found, saying nothing of the other. Placed, registered or one of each: an error naming
    every id; an id (or its short form) picks one."""
    from convgpu.enforcer.books import Ambiguous
    CGROUPS.update({"/convgpu.run/same-1": 301, "/convgpu.run/same-2": 302, "/convgpu.run/same-3": 303})
    rt, books, *_ = part(tmp_path)
    box(books, 1, "same", "/convgpu.run/same-1", 2 * GiB, "convgpu run --limit")
    box(books, 2, "same", "/convgpu.run/same-2", 2 * GiB, "convgpu run --limit")
    with pytest.raises(Ambiguous) as e:
        rt.set_limit("same", 3 * GiB)
    assert str(e.value) == ("'same' names 2 containers: id /convgpu.run/same-1, id /convgpu.run/same-2; give one "
                            "of their ids (`convgpu status` shows them)")
    assert rt.set_limit("same-2", 3 * GiB) == ("same", 3 * GiB)      # its short id
    assert [b.limit for b in books.boxes.values()] == [2 * GiB, 3 * GiB]
    del books.boxes["/convgpu.run/same-2"]
    rt.register_run("/convgpu.run/same-3", GiB, "same")             # one placed, one not yet
    with pytest.raises(Ambiguous) as e:
        rt.set_limit("same", 3 * GiB)
    assert e.value.ids == ["/convgpu.run/same-1", "/convgpu.run/same-3"]


def test_a_limit_below_one_context_or_below_what_a_container_holds_is_refused(tmp_path):
    """A context charged 512 MiB: `convgpu run` and `limit set` below it are refused at once
    (its first CUDA call would wait for good), naming the estimate and where it comes from; a
    limit below what the container holds needs force (it would stop it at once)."""
    from convgpu.enforcer.ctxest import Estimate
    rt, books, *_ = part(tmp_path)
    rt.estimate = lambda dev: Estimate(512 * MiB, "operator", "--ctx-overhead")
    books.ctx_of = lambda dev: 512 * MiB
    with pytest.raises(ConvgpuError) as e:
        rt.register_run("/jobs/run", 256 * MiB, "trainer")
    assert str(e.value) == ("--limit of trainer (256.0 MiB) is below one CUDA context's charge on GPU0: 512.0 MiB "
                            "(operator: --ctx-overhead): its first CUDA call would wait until the limit is raised; "
                            "give at least 512.0 MiB (the context) plus what the job allocates")
    assert rt.durable.value.runs == {}                               # nothing kept
    a = box(books, 1, "a", "/jobs/a", 2 * GiB, "default")
    books.state_of = lambda b, dev: type("S", (), {"used": GiB, "contexts": 1, "reserved": 0, "tearing": 0})()
    with pytest.raises(ConvgpuError, match="below one CUDA context's charge"):
        rt.set_limit("a", 511 * MiB)
    with pytest.raises(ConvgpuError) as e:                          # it holds 1 GiB and a context
        rt.set_limit("a", GiB)
    assert str(e.value) == ("a holds 1.5 GiB on GPU0, more than 1.0 GiB: a lower limit stops it until it frees the "
                            "difference; give at least 1.5 GiB, or add --force")
    assert a.limit == 2 * GiB
    assert rt.set_limit("a", GiB, force=True) == ("a", GiB) and a.limit == GiB


def test_a_failed_reload_says_why(tmp_path):
    """`convgpu reload` said `see the enforcer's log`: the reason is kept for the reply."""
    def bad():
        raise ConvgpuError("invalid config file /etc/convgpu/config.toml: unknown key [enforce] turbo", "fix it")
    rt, *_ = part(tmp_path, reload=bad)
    assert not rt.reload()
    assert rt.reload_error == ("invalid config file /etc/convgpu/config.toml: unknown key [enforce] turbo; fix it")
    rt, *_ = part(tmp_path / "2")
    assert not rt.reload() and rt.reload_error == "no config file was given (--config)"
