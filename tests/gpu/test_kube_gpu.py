"""Issue 26 on the real driver and NVML (the H100): the node agent's view of the GPUs
(kube/health.py) and what Allocate hands out for them. No kubelet: the test-side one."""
import os
import threading

import pytest

pytestmark = pytest.mark.gpu


def test_the_agent_reads_the_real_gpus_healthy_and_watches_xids_without_error():
    from convgpu.kube import devices as dv
    from convgpu.kube.health import NodeGpus
    from convgpu.probes.nvml import Nvml
    nvml = Nvml()
    assert nvml.ok, nvml.error
    node = NodeGpus(nvml, None, 512 << 20)
    gpus = node.read()
    info = nvml.gpus()
    assert [g.uuid for g in gpus] == [g.uuid for g in info] and all(g.uuid.startswith("GPU-") for g in gpus)
    assert [g.capacity for g in gpus] == [g.total - (512 << 20) for g in info]
    assert node.bad() == set() and node.mig == set()
    for g in gpus:
        assert os.path.exists(f"/dev/nvidia{g.minor}")
    stop = threading.Event()
    t = threading.Thread(target=node.watch, args=(stop,), kwargs={"wait_ms": 200}, daemon=True)
    t.start()
    stop.wait(2.0)
    stop.set()
    t.join(timeout=5)
    assert not t.is_alive() and node.bad() == set() and node.xid_at == {}
    grant = dv.allocate(dv.device_ids(gpus, dv.UNIT)[:4], gpus, dv.UNIT)
    assert grant.envs["NVIDIA_VISIBLE_DEVICES"] == gpus[0].uuid and grant.cdi == [f"nvidia.com/gpu={gpus[0].uuid}"]
    assert (f"/dev/nvidia{gpus[0].minor}", f"/dev/nvidia{gpus[0].minor}", "rw") in grant.devices
    nvml.close()
