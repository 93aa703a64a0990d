"""Row 10 of docs/SECURITY.md: a pod's author writes convgpu.io/gpu-memory-limit. It may lower
the pod's limit, never raise it above what the operator's [[rule]]s (containers without units)
or the pod's units allow. Attack: a pod annotated 64GiB on a node whose operator limits every
pod to 512 MiB by rule; its container asks no units and allocates 3 x 256 MiB from an
unprivileged process in the pod's cgroup, against a real enforcer on the stand-in driver. It is
stopped at its third allocation (512 MiB, the rule), as is a second pod that has 2 units and the
same annotation. A third pod lowers itself to 256 MiB by annotation: that holds."""
import pytest

from conftest import GiB, MiB, inprocess_enforcer, serving, start_in, until, wait_state
from convgpu.enforcer.tenants.config import Rule
from convgpu.kube import api
from convgpu.kube.pods import ANNOTATION, PodMeta, PodSync
from kubelet_side import Kubelet

pytestmark = pytest.mark.system
UNIT = 256 * MiB
UIDS = ("1a0a0a0a-1111-2222-3333-444444444444", "1b0b0b0b-5555-6666-7777-888888888888",
        "1c0c0c0c-9999-aaaa-bbbb-cccccccccccc")
CIDS = ("c1" * 32, "c2" * 32, "c3" * 32)
PODS = ("greedy", "greedy-units", "modest")


class Annotated:
    """The API server's view: the pods' uids, annotations and container ids."""

    def pods(self):
        anns = ({ANNOTATION: "64GiB"}, {ANNOTATION: "64GiB"}, {ANNOTATION: "256MiB"})
        return {("t", p): PodMeta(u, a, {"main": {c}}) for p, u, a, c in zip(PODS, UIDS, anns, CIDS)}


def _listing(m):
    def pod(name, units):
        return m.PodResources(namespace="t", name=name, containers=[m.ContainerResources(name="main", devices=[
            m.ContainerDevices(resource_name="convgpu.io/gpu-memory", device_ids=[f"gpu0::{i}" for i in range(units)])]
            if units else [])])
    return [pod("greedy", 0), pod("greedy-units", 2), pod("modest", 0)]


def test_an_annotation_never_raises_a_limit_above_the_rules_or_the_units(root, build, cgroups, caller_env, tmp_path):
    enf = inprocess_enforcer(build / "standin" / "libcuda.so.1", "row10", 4 * GiB)
    enf.rules.rules = [Rule("cgroup", "*kubepods*", 512 * MiB)]      # the operator's rule
    cgs = [cgroups(f"kubepods/besteffort/pod{u}/{c}") for u, c in zip(UIDS, CIDS)]
    kubelet = Kubelet(str(tmp_path), str(tmp_path / "pod-resources.sock"))
    m, _ = api.podresources()
    kubelet.pods = _listing(m)
    kubelet.start()
    procs = []
    try:
        with serving(enf):
            PodSync(enf.control_path, [Annotated()], UNIT, str(tmp_path / "pod-resources.sock")).round()
            procs = [start_in(cg, build, caller_env, "alloc", "-n", 3, "-s", 256 * MiB, "--hold") for cg in cgs]
            for p in procs:
                wait_state(p.pid, "T")          # each stopped: over 512, 512 and 256 MiB
            until(lambda: all(_status(enf).get(c, {}).get("over_limit_events") == 1 for c in CIDS[:2]), 10, "over")
            # the third's first allocation: in the books once its return was taken (not at its stop)
            until(lambda: _status(enf).get(CIDS[2], {}).get("gpus", {}).get("0", {}).get("used") == 256 * MiB, 10,
                  "the third's 256 MiB")
            st = _status(enf)
            assert [(st[c]["limit"], st[c]["gpus"]["0"]["used"]) for c in CIDS] == \
                [(512 * MiB, 512 * MiB), (512 * MiB, 512 * MiB), (256 * MiB, 256 * MiB)]
            assert st[CIDS[0]]["source"] == "rule cgroup '*kubepods*'"
            assert st[CIDS[1]]["source"] == "pod t/greedy-units main: 2 x 256 MiB convgpu.io/gpu-memory"
            assert st[CIDS[2]]["source"].startswith(f"pod t/modest annotation {ANNOTATION} (under 512.0 MiB")
    finally:
        for p in procs:
            p.kill()
            p.wait()
        kubelet.stop()


def _status(enf):
    from convgpu.enforcer.serving.server import request
    return {c["id"]: c for c in request(enf.control_path, {"cmd": "status"})["status"]["containers"]}
