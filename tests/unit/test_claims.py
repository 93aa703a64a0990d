"""The enforcer's side of DRA claims (issue 40), without a kernel: the entry's checks, the limit a
container gets from its pod's claims (enforcer/tenants/claims.py), their place in the decisions
file, and the control commands (enforcer/serving/claimlimits.py) on an enforcer over the ledger
(no BPF): idempotent, one claim at a time, refused past a GPU's capacity, on a GPU the enforcer
does not know, and on a GPU whose memory the device plugin shares out."""
import logging

import pytest

from convgpu.enforcer.daemon import Enforcer
from convgpu.enforcer.serving import claimlimits, podlimits
from convgpu.enforcer.tenants import decisionfile
from convgpu.enforcer.tenants.claims import ClaimShare, binding, budget_limit, parse
from convgpu.enforcer.tenants.containers import Container
from convgpu.enforcer.tenants.limits import LimitRules, PodLimit
from convgpu.errors import ConvgpuError
from convgpu.probes.ledger import Ledger
from convgpu.probes.nvml import GpuInfo

MiB, GiB = 1 << 20, 1 << 30
POD, OTHER = "0d0d0d0d-1111-2222-3333-444444444444", "0e0e0e0e-1111-2222-3333-444444444444"
A, B = "a" * 64, "b" * 64


def share(ref, gpus, pods=(POD,), containers=()):
    return ClaimShare(ref, tuple(pods), tuple(sorted(gpus.items())), tuple(containers))


@pytest.mark.parametrize("uid, raw", [
    ("", {"claim": "ml/c", "pods": [POD], "gpus": {"gpu0": 1}}),
    ("u/1", {"claim": "ml/c", "pods": [POD], "gpus": {"gpu0": 1}}),
    ("u", {"claim": "", "pods": [POD], "gpus": {"gpu0": 1}}),
    ("u", {"claim": "ml/c", "pods": [], "gpus": {"gpu0": 1}}),
    ("u", {"claim": "ml/c", "pods": [POD], "gpus": {}}),
    ("u", {"claim": "ml/c", "pods": [POD], "gpus": {"gpu0": 0}}),
    ("u", {"claim": "ml/c", "pods": [POD], "gpus": {"gpu0": True}}),
    ("u", {"claim": "ml/c", "pods": [POD] * 257, "gpus": {"gpu0": 1}}),
    ("u", {"claim": "ml/c", "pods": [POD], "gpus": {"gpu0": 1}, "containers": "x"}),
    ("u", ["ml/c"]),
])
def test_a_bad_entry_is_refused_naming_the_claim(uid, raw):
    with pytest.raises(ConvgpuError) as e:
        parse(uid, raw)
    assert "invalid claim" in str(e.value)


def test_the_claims_that_bind_a_container_and_their_budget():
    claims = {"1": share("ml/a", {"GPU-0": GiB}, containers=[A]), "2": share("ml/b", {"GPU-0": 3 * GiB}),
              "3": share("ml/c", {"GPU-1": 2 * GiB}, containers=[A, B]), "9": share("ml/z", {"GPU-0": 8 * GiB}, pods=[OTHER]),
              "8": ClaimShare("ml/y", (OTHER,), (("GPU-1", GiB),), (), (POD,))}   # a second pod seen using it
    # matched: the claims it uses; not matched yet (a new or restarted container): every claim of its pod,
    # those it is reserved for and those the agent saw it use
    assert binding(claims, A, POD) == ("1", "3")
    assert binding(claims, "c" * 64, POD) == ("1", "2", "3", "8")
    assert binding(claims, A, "0f0f0f0f-0000-0000-0000-000000000000") == ("1", "3") and binding({}, A, POD) == ()
    assert binding(claims, "c" * 64, "0f0f0f0f-0000-0000-0000-000000000000") == ()
    # a budget's limit: its claims' shares per GPU, 0 on a GPU none of them names
    got = budget_limit(claims, ("1", "3", "gone"))
    assert got == PodLimit(3 * GiB, "DRA claim ml/a + ml/c", False, (("GPU-0", GiB), ("GPU-1", 2 * GiB)),
                           "ml/ResourceClaim/a+c", named_only=True)
    assert budget_limit(claims, ("gone",)) is None
    rules = LimitRules({}, 16 * GiB, claims=claims, pods={A: PodLimit(5 * GiB, "units")})
    c = Container("kubernetes", A, f"/kubepods/pod{POD}/{A}", POD)
    assert rules.limit_for(c, None, None) == (3 * GiB, "DRA claim ml/a + ml/c")   # the claims beat pod limits
    budget = rules.budget({"2"})
    assert rules.limit_for(c, None, None, budget) == (3 * GiB, "DRA claim ml/b")  # the budget the books say
    assert [rules.share(c, g, 3 * GiB, "DRA claim ml/a + ml/c") for g in ("GPU-0", "GPU-1", "GPU-2")] == [GiB, 2 * GiB, 0]
    # the device plugin's grant keeps its limit on a GPU it does not name (an ordinal not mapped yet)
    d = Container("kubernetes", "d" * 64, "/kubepods/podx/d", "0f0f0f0f-0000-0000-0000-000000000000")
    rules.pods = {d.id: PodLimit(2 * GiB, "units", False, (("GPU-0", 2 * GiB),))}
    assert rules.share(d, "GPU-1", 2 * GiB, "units") == 2 * GiB


def test_claims_are_kept_in_the_decisions_file():
    d = decisionfile.Decisions().with_claims({"u1": share("ml/a", {"GPU-0": GiB}, containers=[A])})
    assert decisionfile.decode(decisionfile.encode(d)) == d
    assert d.counts() == {"runs": 0, "limits": 0, "pods": 0, "claims": 1}


class Nvml:
    ok, driver = True, "580.159.04"

    def gpus(self):
        return [GpuInfo(i, "NVIDIA H100 80GB HBM3", 80 * GiB, 0, f"GPU-{i}") for i in range(2)]


@pytest.fixture
def enf(tmp_path):
    e = Enforcer(Ledger().start(), "fifo", {0: 4 * GiB, 1: 4 * GiB}, LimitRules({}, GiB), nvml=Nvml(),
                 run_dir=str(tmp_path / "run"), state_dir=str(tmp_path / "state"))
    e.durable.open(wait=0)
    yield e.runtime   # what the claim commands are handed (serving/control.py)
    e.durable.close()


def wire(ref, gpus, pods=(POD,)):
    return {"claim": ref, "pods": list(pods), "gpus": gpus}


def test_prepare_is_idempotent_and_refuses_what_it_cannot_hold(enf):
    assert claimlimits.prepare(enf, "u1", wire("ml/a", {"GPU-0": 3 * GiB})) == {"changed": True}
    writes = enf.durable.writes
    assert claimlimits.prepare(enf, "u1", wire("ml/a", {"GPU-0": 3 * GiB})) == {"changed": False}
    assert enf.durable.writes == writes
    with pytest.raises(ConvgpuError) as e:     # 3 + 2 GiB past the GPU's 4
        claimlimits.prepare(enf, "u2", wire("ml/b", {"GPU-0": 2 * GiB}))
    assert "claim ml/b: 2.0 GiB on GPU GPU-0 would put its claims at 5.0 GiB, past its 4.0 GiB" in str(e.value)
    with pytest.raises(ConvgpuError) as e:
        claimlimits.prepare(enf, "u3", wire("ml/c", {"GPU-9": GiB}))
    assert "GPU GPU-9 is not one of the enforcer's GPUs (GPU-0, GPU-1)" in str(e.value)
    assert list(enf.rules.claims) == ["u1"] and enf.durable.writes == writes   # nothing else kept
    assert claimlimits.containers(enf, {"u1": [A], "gone": [B]}) == {"changed": True}
    assert enf.rules.claims["u1"].containers == (A,)
    assert claimlimits.prepare(enf, "u1", wire("ml/a", {"GPU-0": 3 * GiB})) == {"changed": False}   # keeps its match
    assert claimlimits.unprepare(enf, "u1") == {"changed": True} and enf.rules.claims == {}
    assert claimlimits.unprepare(enf, "u1") == {"changed": False}


def test_a_gpu_is_shared_by_the_device_plugin_or_by_dra_never_both(enf):
    podlimits.apply(enf, {A: [GiB, "units", {"lower_only": False, "gpus": {"GPU-1": GiB}}]})
    with pytest.raises(ConvgpuError) as e:
        claimlimits.prepare(enf, "u1", wire("ml/a", {"GPU-1": GiB}))
    assert "GPU GPU-1 is shared out by the device plugin's pod limits" in str(e.value)
    assert claimlimits.prepare(enf, "u2", wire("ml/b", {"GPU-0": GiB})) == {"changed": True}
    with pytest.raises(ConvgpuError) as e:
        podlimits.apply(enf, {B: [GiB, "units", {"lower_only": False, "gpus": {"GPU-0": GiB}}]})
    assert "pod limits refused: GPU GPU-0 holds DRA claims" in str(e.value)
    assert enf.rules.pods == {A: PodLimit(GiB, "units", False, (("GPU-1", GiB),))}   # the previous set stays


def test_a_claim_is_one_budget_for_every_container_that_uses_it(tmp_path):
    """Issue 48, the books (an enforcer over the ledger, no kernel; containers looked up by pid
    from a table): the containers a claim binds share one Box; a budget holds each claim once;
    a container placed before the agent said it uses a claim another budget holds gets 0, and
    one whose claim no budget holds yet takes it; an unprepared claim leaves its budget."""
    P, Q, S = POD, OTHER, "0f0f0f0f-1111-2222-3333-444444444444"
    cs = {pid: Container("kubernetes", cid * 64, f"/kubepods/pod{pod}/{cid * 64}", pod)
          for pid, cid, pod in ((10, "a", P), (20, "b", P), (30, "c", Q), (40, "d", S), (50, "e", S))}
    e = Enforcer(Ledger().start(), "fifo", {0: 4 * GiB, 1: 4 * GiB}, LimitRules({}, GiB), nvml=Nvml(),
                 run_dir=str(tmp_path / "run"), state_dir=str(tmp_path / "state"), container_of=lambda pid: cs[pid])
    e.durable.open(wait=0)
    rt, books, place = e.runtime, e.books, e.placement
    try:
        got = claimlimits.prepare_all(rt, {"x": wire("ml/x", {"GPU-0": GiB}), "y": wire("ml/y", {"GPU-1": 2 * GiB}),
                                           "z": wire("ml/z", {"GPU-0": GiB}, pods=(Q,)),
                                           "w": wire("ml/w", {"GPU-1": 768 * MiB}, pods=(Q,)),
                                           "t": wire("ml/t", {"GPU-1": GiB}, pods=("1e1e1e1e-0000-0000-0000-0000000000aa",))})
        assert got == {"claims": {u: {"changed": True} for u in "xyzwt"}}
        # two containers of P, not matched yet: bound by both its claims, one budget
        a, b = place.box_for(10), place.box_for(20)
        place.join(a, 10), place.join(b, 20)
        assert a is b and (a.container.id, a.container.kind, a.name, a.claims) == ("claim:x", "claim", "ml/x + ml/y", {"x", "y"})
        assert (a.limit, a.source, sorted(a.members), a.cgroups) == (
            3 * GiB, "DRA claim ml/x + ml/y", ["a" * 64, "b" * 64], (cs[10].cgroup, cs[20].cgroup))
        assert [books.limit(a, d) for d in (0, 1)] == [GiB, 2 * GiB] and len(books.boxes) == 1
        # Q's container: its claims' budget, 0 on a GPU they do not name
        c = place.box_for(30)
        place.join(c, 30)
        assert (c.claims, c.limit, books.limit(c, 0), books.limit(c, 1)) == ({"z", "w"}, 1792 * MiB, GiB, 768 * MiB)
        # S's containers were placed before the agent told that S uses z and w: budgets of their own
        d, f = place.box_for(40), place.box_for(50)
        place.join(d, 40), place.join(f, 50)
        assert [(x.container.id, x.limit, x.source) for x in (d, f)] == [("d" * 64, GiB, "default"), ("e" * 64, GiB, "default")]
        # now it does: d matched to z, which Q's budget holds. Its memory cannot be moved there, and a
        # budget of its own would count z twice: 0. f, not matched, is bound by S's claims, z and t:
        # it takes t, which no budget holds yet
        claimlimits.containers(rt, {"z": {"containers": ["d" * 64], "users": [S]}, "t": {"users": [S]}})
        assert (d.claims, d.limit) == (set(), 0) and d.source.startswith("DRA claim ml/z (held by another budget")
        assert (f.claims, f.limit, f.source, books.limit(f, 0)) == ({"t"}, GiB, "DRA claim ml/t", 0)
        assert (c.claims, books.limit(c, 0)) == ({"z", "w"}, GiB)   # Q's budget as it was
        # an unprepared claim leaves its budget: P's holds y alone, and a new claim of P's goes to it
        assert claimlimits.unprepare(rt, ["x"]) == {"changed": True}
        assert (a.claims, a.limit, books.limit(a, 0), books.limit(a, 1)) == ({"y"}, 2 * GiB, 0, 2 * GiB)
        claimlimits.prepare_all(rt, {"v": wire("ml/v", {"GPU-0": GiB})})
        assert (a.claims, a.limit) == ({"y", "v"}, 3 * GiB)
        # a member's last process leaves: the budget stays with the other
        place.gone(10)
        assert sorted(a.members) == ["b" * 64] and books.boxes["claim:x"] is a
        with pytest.raises(ConvgpuError, match="is a DRA claim's budget, shared by 1 container"):
            rt.set_limit("b" * 64, GiB)
    finally:
        e.durable.close()


def test_a_claim_or_pod_limit_no_context_fits_in_is_refused_or_said_at_once(enf, caplog):
    """Issue 52: a limit below one context's charge made every CUDA call of its pod wait for
    good, and only a log line about the stalled call said why. A DRA claim is refused at its
    prepare (the kubelet reports it on the pod); the device plugin's pods were scheduled
    already, so their limit is said in the log, once."""
    caplog.set_level(logging.WARNING, logger="convgpu")
    with pytest.raises(ConvgpuError) as e:   # an H100 on driver 580: its context is charged 550 MiB
        claimlimits.prepare(enf, "u1", wire("ml/tiny", {"GPU-0": 256 * MiB}))
    msg = str(e.value)
    assert msg.startswith("claim ml/tiny: its share (256.0 MiB) is below one CUDA context's charge on GPU0: "
                          "550.0 MiB (table-hint: nothing measured: the table's H100 80GB HBM3, driver 580") and \
        msg.endswith("); ask for the context plus what the job allocates (`convgpu status` shows the context per "
                     "GPU)") and "\n" not in msg, msg
    assert enf.rules.claims == {}
    for _ in range(2):   # the agent sends its set every round: said once
        podlimits.apply(enf, {A: [256 * MiB, "pod ml/p: 1 unit", {"lower_only": False, "gpus": {"GPU-1": 256 * MiB}}]})
    said = [r.getMessage() for r in caplog.records if "below one CUDA context" in r.getMessage()]
    assert said == [f"the pod limit of {A} (pod ml/p: 1 unit) (256.0 MiB) is below one CUDA context's charge on "
                    f"GPU1: 550.0 MiB (table-hint: {said[0].split('(table-hint: ', 1)[1]}"] and \
        said[0].endswith("a process there waits at its first CUDA call until the limit is raised")
    assert enf.rules.pods[A].bytes == 256 * MiB    # kept all the same: the scheduler placed it
