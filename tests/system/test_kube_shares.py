"""Issue 26 item 1 on a real enforcer (stand-in driver with two devices, real cgroups): a pod
granted 4 units split 3 + 1 over two GPUs is limited on each GPU to that GPU's share, so it can
hold 1 GiB in all, as the scheduler counted, and not 1 GiB on each GPU. The split comes from the
agent (PodSync over the test-side kubelet's pod-resources answer) keyed by the GPU."""
import pytest

from conftest import GiB, MiB, inprocess_enforcer, read_until, serving, start_in, until, wait_state
from convgpu.kube import api
from convgpu.kube.pods import KubeletLogPods, PodSync
from kubelet_side import Kubelet

pytestmark = pytest.mark.system
UNIT = 256 * MiB
UID = "5a0a0a0a-1111-2222-3333-444444444444"
CID = "d5" * 32


def test_a_grant_over_two_gpus_is_limited_on_each_to_its_share(root, build, cgroups, caller_env, tmp_path):
    enf = inprocess_enforcer(build / "standin" / "libcuda.so.1", "shares", 4 * GiB, capacity={0: 4 * GiB, 1: 4 * GiB})
    cg = cgroups(f"kubepods/besteffort/pod{UID}/{CID}")
    logs = tmp_path / "log"
    (logs / "containers").mkdir(parents=True)
    (logs / "containers" / f"big_ml_train-{CID}.log").symlink_to("/nonexistent")
    m, _ = api.podresources()
    kubelet = Kubelet(str(tmp_path), str(tmp_path / "pod-resources.sock"))
    kubelet.pods = [m.PodResources(namespace="ml", name="big", containers=[m.ContainerResources(name="train", devices=[
        m.ContainerDevices(resource_name="convgpu.io/gpu-memory",
                           device_ids=["gpu0::0", "gpu0::1", "gpu0::2", "gpu1::0"])])])]
    kubelet.start()
    env = dict(caller_env, CONVGPU_STANDIN_DEVICES="2")
    a = b = None
    try:
        with serving(enf):
            sent = PodSync(enf.control_path, [KubeletLogPods(str(logs))], UNIT, str(tmp_path / "pod-resources.sock")).round()
            assert sent[CID].gpus == (("gpu0", 3 * UNIT), ("gpu1", UNIT))
            a = start_in(cg, build, env, "alloc", "-n", 3, "-s", 256 * MiB, "-d", 0, "--hold")
            assert f"allocated 3 {768 * MiB} pid={a.pid}" in read_until(a, "ready")   # its 768 MiB on GPU0
            b = start_in(cg, build, env, "alloc", "-n", 2, "-s", 256 * MiB, "-d", 1, "--hold")
            wait_state(b.pid, "T")                     # a second 256 MiB on GPU1: over its 256 MiB share
            until(lambda: _row(enf).get("over_limit_events") == 1, 10, "over its share on GPU1")
            row = _row(enf)
            assert row["limit"] == GiB
            assert (row["gpus"]["0"]["limit"], row["gpus"]["1"]["limit"]) == (768 * MiB, 256 * MiB)
            assert (row["gpus"]["0"]["used"], row["gpus"]["1"]["used"]) == (768 * MiB, 256 * MiB)
    finally:
        for p in (a, b):
            if p is not None:
                p.kill()
                p.wait()
        kubelet.stop()


def _row(enf):
    from convgpu.enforcer.serving.server import request
    return {c["id"]: c for c in request(enf.control_path, {"cmd": "status"})["status"]["containers"]}.get(CID, {})
