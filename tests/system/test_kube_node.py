"""`convgpu kube` on a node of two GPUs (the stand-in NVML in a subprocess, the test-side kubelet
over the real gRPC protocol): a grant stays on one GPU when it fits, spans with each GPU's share
when it does not; Allocate offers the shim (read-only) and CDI names; one GPU's XID or NVML error
takes only its own units down and they come back; MIG GPUs are left out; a kubelet restart
re-registers with the health kept."""
import os
import queue
import subprocess
import sys
import time

import pytest

from convgpu.kube import api
from kubelet_side import Kubelet, Node

pytestmark = pytest.mark.system
GiB = 1 << 30
UNIT = 256 << 20


def _latest(q, want, timeout=20.0):
    """The first ListAndWatch list for which want(list) holds, within timeout."""
    end = time.monotonic() + timeout
    last = None
    while time.monotonic() < end:
        try:
            last = q.get(timeout=max(0.01, end - time.monotonic()))
        except queue.Empty:
            break
        if want(last):
            return last
    raise AssertionError(f"no such list within {timeout}s; last: {last and sorted(set(h for _, h in last))}")


def _health(lst, uuid):
    return {h for d, h in lst if d.startswith(uuid + "::")}


@pytest.fixture
def agent(build, tmp_path):
    plugins = tmp_path / "device-plugins"
    plugins.mkdir()
    node = Node(build, tmp_path)
    kubelet = Kubelet(str(plugins)).start()
    env = dict(os.environ, **node.env)
    log = open(tmp_path / "agent.log", "w")    # a file, not a pipe: a full pipe would block the agent
    p = subprocess.Popen([sys.executable, "-m", "convgpu.cli.main", "kube", "--reserve", "0", "--unit", "256MiB",
                          "--plugin-dir", str(plugins), "--no-limits", "--api", "off", "--run-dir", str(tmp_path / "run"),
                          "--inventory-every", "0.2", "--recover-after", "1.5"],
                         env=env, stderr=log, text=True)
    try:
        yield node, kubelet, p, tmp_path
    finally:
        p.terminate()
        try:
            p.wait(timeout=30)
        finally:
            log.close()
            kubelet.stop()


def test_two_gpus_one_gpu_per_grant_shim_and_cdi(agent):
    node, kubelet, p, tmp = agent
    kubelet.registrations.get(timeout=60)
    first = kubelet.lists.get(timeout=10)
    a, b = node.uuids
    assert first == [(f"{u}::{i}", "Healthy") for u in (a, b) for i in range(16)]
    m, _ = api.deviceplugin()
    stub = kubelet.plugin()
    # GPU a has 4 units free, b 12: 8 units fit b only, and stay on it
    free = [f"{a}::{i}" for i in range(12, 16)] + [f"{b}::{i}" for i in range(4, 16)]
    pref = stub.GetPreferredAllocation(m.PreferredAllocationRequest(container_requests=[
        m.ContainerPreferredAllocationRequest(available_deviceIDs=free, allocation_size=8)]), timeout=5)
    assert list(pref.container_responses[0].deviceIDs) == [f"{b}::{i}" for i in range(4, 12)]
    # 20 units fit no GPU: 16 on one, 4 on the other, each GPU's share said to the enforcer's side
    ids = [f"{a}::{i}" for i in range(16)] + [f"{b}::{i}" for i in range(4)]
    r = stub.Allocate(m.AllocateRequest(container_requests=[m.ContainerAllocateRequest(devices_ids=ids)]),
                      timeout=5).container_responses[0]
    assert r.envs["NVIDIA_VISIBLE_DEVICES"] == f"{a},{b}"
    assert r.envs["CONVGPU_GPU_MEMORY_LIMIT"] == str(20 * UNIT)
    assert (r.envs["LD_PRELOAD"], r.envs["CONVGPU_SHIM_SOCKET"]) == \
        ("/opt/convgpu/libconvgpu.so", "/run/convgpu/shim/shim.sock")
    mounts = {mt.container_path: (mt.host_path, mt.read_only) for mt in r.mounts}
    assert mounts["/opt/convgpu/libconvgpu.so"] == (str(tmp / "run" / "lib" / "libconvgpu.so"), True)
    assert mounts["/run/convgpu/shim"] == (str(tmp / "run" / "shim"), True)
    lib = tmp / "run" / "lib" / "libconvgpu.so"
    assert lib.stat().st_mode & 0o777 == 0o755 and lib.read_bytes()[:4] == b"\x7fELF"
    assert [c.name for c in r.cdi_devices] == [f"nvidia.com/gpu={a}", f"nvidia.com/gpu={b}"]
    assert p.poll() is None


def test_one_gpus_xid_or_error_takes_only_its_units_and_they_come_back(agent):
    node, kubelet, p, tmp = agent
    kubelet.registrations.get(timeout=60)
    a, b = node.uuids
    kubelet.lists.get(timeout=10)
    node.xid(1, 13)                     # an application's XID: nothing changes
    node.xid(1, 79)                     # fallen off the bus: GPU b's units only
    lst = _latest(kubelet.lists, lambda x: _health(x, b) == {"Unhealthy"})
    assert _health(lst, a) == {"Healthy"} and len(lst) == 32
    lst = _latest(kubelet.lists, lambda x: _health(x, b) == {"Healthy"})     # 1.5 s later, NVML answering
    assert _health(lst, a) == {"Healthy"}
    node.lose(0)                        # NVML errors for GPU a: its units stay listed, unhealthy
    lst = _latest(kubelet.lists, lambda x: _health(x, a) == {"Unhealthy"})
    assert _health(lst, b) == {"Healthy"} and len(lst) == 32
    kubelet = kubelet.restart()         # a kubelet restart meanwhile: registered again, health kept
    kubelet.registrations.get(timeout=30)
    lst = kubelet.lists.get(timeout=10)
    assert (_health(lst, a), _health(lst, b)) == ({"Unhealthy"}, {"Healthy"})
    node.heal()
    lst = _latest(kubelet.lists, lambda x: _health(x, a) == {"Healthy"})
    assert _health(lst, b) == {"Healthy"} and len(lst) == 32
    node.mig(1)                         # GPU b put in MIG mode: no longer shared by convgpu
    lst = _latest(kubelet.lists, lambda x: len(x) == 16)
    assert lst == [(f"{a}::{i}", "Healthy") for i in range(16)]
    assert p.poll() is None
    kubelet.stop()
    err = (tmp / "agent.log").read_text()
    assert "XID 13 (an application's error)" in err and "XID 79: its units are unhealthy" in err
    assert "is in MIG mode: not shared by convgpu" in err
