"""The order of limits for a pod's container (enforcer/tenants/limits.py, docs/KUBERNETES.md):
`limit set` > --limit > the pod's units > [[rule]] > label > default, then the pod's annotation,
which only lowers. And the `pod-limits` wire format, bad input refused with the fix."""
import pytest

from convgpu.enforcer.serving.podlimits import parse
from convgpu.enforcer.tenants.config import Rule
from convgpu.enforcer.tenants.containers import Container
from convgpu.enforcer.tenants.limits import LimitRules, PodLimit
from convgpu.errors import ConvgpuError

MiB, GiB = 1 << 20, 1 << 30
CID, UID = "e" * 64, "12345678-1234-1234-1234-123456789abc"
C = Container("containerd", CID, f"/kubepods/pod{UID}/{CID}", UID)
ANN = PodLimit(64 * GiB, "pod t/p annotation convgpu.io/gpu-memory-limit", True)


def rules(**kw):
    return LimitRules({}, 1 * GiB, [Rule("cgroup", "*kubepods*", 2 * GiB)], **kw)


def test_an_annotation_lowers_the_rule_and_never_raises_it():
    assert rules(pods={CID: ANN}).limit_for(C, None, None) == (2 * GiB, "rule cgroup '*kubepods*'")
    low = ANN._replace(bytes=512 * MiB)
    got = rules(pods={CID: low}).limit_for(C, None, None)
    assert got == (512 * MiB, f"{low.source} (under 2.0 GiB: rule cgroup '*kubepods*')")
    got = LimitRules({}, 1 * GiB, pods={UID: low}).limit_for(C, None, None)      # by pod uid, under the default
    assert got[0] == 512 * MiB and got[1].endswith("(under 1.0 GiB: default)")
    # and under a label: a label is a tenant's too, the smaller wins
    assert LimitRules({}, 8 * GiB, pods={CID: ANN}).limit_for(C, None, {"com.nvidia.memory.limit": "3GiB"}) == \
        (3 * GiB, "label com.nvidia.memory.limit")


def test_units_beat_rules_and_the_operator_beats_units():
    units = PodLimit(4 * GiB, "pod t/p main: 16 x 256 MiB convgpu.io/gpu-memory", False, (("GPU-a", 4 * GiB),))
    assert rules(pods={CID: units}).limit_for(C, None, None) == (4 * GiB, units.source)
    assert rules(pods={CID: units}, runtime={CID: GiB}).limit_for(C, None, None) == (GiB, "convgpu limit set")
    assert LimitRules({CID[:12]: 3 * GiB}, pods={CID: units}).limit_for(C, None, None) == (3 * GiB, f"--limit {CID[:12]}")
    assert rules(pods={CID: units}).shares_for(C) == {"GPU-a": 4 * GiB}
    assert rules(pods={CID: ANN}).shares_for(C) == {}
    # "no units" (0, lower_only): the rules, not the pod uid's grant
    sidecar = PodLimit(0, "pod t/p side: no convgpu.io/gpu-memory", True)
    assert rules(pods={CID: sidecar, UID: units}).limit_for(C, None, None) == (2 * GiB, "rule cgroup '*kubepods*'")


def test_the_wire_format_old_and_new_and_bad_input():
    assert parse({CID: [GiB, "s"]}) == {CID: PodLimit(GiB, "s")}
    assert parse({CID: [GiB, "s", {"lower_only": True, "gpus": {"GPU-b": 1, "GPU-a": 2}}]}) == \
        {CID: PodLimit(GiB, "s", True, (("GPU-a", 2), ("GPU-b", 1)))}
    assert parse({CID: [0, "s", {"lower_only": True}]})[CID].bytes == 0
    for bad in ([0, "s"], [-1, "s"], [True, "s"], [GiB, "s", {"lower_only": "yes"}],
                [GiB, "s", {"gpus": {"": 1}}], [GiB, "s", {"gpus": {"a": -1}}], [GiB, "s", []], [GiB]):
        with pytest.raises(ConvgpuError) as e:
            parse({CID: bad})
        assert "send {key: [bytes, source]}" in e.value.fix
