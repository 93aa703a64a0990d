"""The enforcer's side of the Kubernetes agent: the `pod-limits` message and where a pod's limit
stands among the other sources (enforcer/tenants/limits.py, enforcer/serving/podlimits.py)."""
import pytest

from convgpu.enforcer.tenants.config import Rule
from convgpu.enforcer.tenants.containers import container_of_path
from convgpu.enforcer.tenants.limits import LimitRules, PodLimit
from convgpu.enforcer.serving.podlimits import parse
from convgpu.errors import ConvgpuError

CID = "c" * 64
UID = "0a0a0a0a-1111-2222-3333-444444444444"
C = container_of_path(f"/kubepods/burstable/pod{UID}/{CID}")


def test_a_pods_limit_by_container_id_or_pod_uid():
    assert (C.kind, C.id, C.pod) == ("kubernetes", CID, UID)
    r = LimitRules(default=1 << 30, pods={UID: (5 << 20, "pod uid")})
    assert r.limit_for(C, None, {"com.nvidia.memory.limit": "3GiB"}) == (5 << 20, "pod uid")
    r.pods[CID] = (7 << 20, "container")
    assert r.limit_for(C, None, None) == (7 << 20, "container")     # the container's own beats its pod's
    r.explicit[CID[:12]] = 9 << 20
    assert r.limit_for(C, None, None) == (9 << 20, f"--limit {CID[:12]}")
    r.runtime[CID] = 11 << 20
    assert r.limit_for(C, None, None) == (11 << 20, "convgpu limit set")


def test_a_pods_limit_beats_config_rules_and_labels():
    rule = Rule("cgroup", "/kubepods/*", 2 << 20)
    r = LimitRules(rules=[rule], pods={CID: (3 << 20, "pod")})
    assert r.limit_for(C, None, {"com.nvidia.memory.limit": "1GiB"}) == (3 << 20, "pod")
    r.pods.clear()
    assert r.limit_for(C, None, None) == (2 << 20, "rule cgroup '/kubepods/*'")


@pytest.mark.parametrize("bad", [[], {"x": 5}, {"x": [0, "s"]}, {"x": [True, "s"]}, {"": [1, "s"]},
                                 {"x": [1, 2]}, {"x": [1.5, "s"]}])
def test_bad_pod_limits_are_refused(bad):
    with pytest.raises(ConvgpuError):
        parse(bad)


def test_pod_limits_parse():
    assert parse({CID: [1 << 30, "pod ml/a"], UID: (2, "b")}) == {CID: PodLimit(1 << 30, "pod ml/a", False, (), ""),
                                                                  UID: PodLimit(2, "b", False, (), "")}


def test_a_pods_job_crosses_the_wire_and_is_bounded():
    """The agent names each container's job (issue 42); the enforcer keeps it with the limit."""
    p = PodLimit(1 << 30, "pod ml/a c", False, (("g", 1 << 30),), "ml/Deployment/web/c")
    assert p.wire() == [1 << 30, "pod ml/a c", {"lower_only": False, "gpus": {"g": 1 << 30}, "job": "ml/Deployment/web/c"}]
    assert parse({CID: p.wire()}) == {CID: p}
    assert PodLimit(1, "s").wire() == [1, "s", {"lower_only": False, "gpus": {}}]    # none: as before
    for bad in (5, None, "x" * 601):
        with pytest.raises(ConvgpuError):
            parse({CID: [1, "s", {"job": bad}]})
