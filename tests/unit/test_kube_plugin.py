"""The device plugin against a test-side kubelet (tests/kubelet_side.py) over the kubelet's real
gRPC protocol on UNIX sockets: registration, re-registration after a kubelet restart, the
ListAndWatch list and its update, preferred allocation on one GPU, Allocate. No root needed."""
import json
import os
import queue
import threading
import time

import grpc
import pytest

from convgpu.kube import api, devices as dv
from convgpu.kube.plugin import DevicePlugin
from kubelet_side import Kubelet

MiB = 1 << 20
UNIT = 256 * MiB
A, B = "GPU-aaaaaaaa-0000-0000-0000-000000000000", "GPU-bbbbbbbb-0000-0000-0000-000000000000"
GPUS = [dv.Gpu(0, 1024 * MiB, A, minor=0), dv.Gpu(1, 512 * MiB + 100, B, minor=3)]


def ids(key, n):
    return [f"{key}::{i}" for i in range(n)]


def got(q, timeout=10):
    try:
        return q.get(timeout=timeout)
    except queue.Empty:
        raise AssertionError("nothing came from the plugin in time") from None


@pytest.fixture
def node(tmp_path):
    d = tmp_path / "device-plugins"
    d.mkdir()
    kubelet = Kubelet(str(d)).start()
    plugin = DevicePlugin(str(d), GPUS, UNIT, dev_root=str(tmp_path / "dev"))
    stop = threading.Event()
    t = threading.Thread(target=plugin.run, args=(stop, 0.05), daemon=True)
    t.start()
    box = {"kubelet": kubelet}
    yield plugin, box
    stop.set()
    t.join(timeout=10)
    box["kubelet"].stop()


def test_registers_and_lists_units_of_each_gpu(node):
    plugin, box = node
    k = box["kubelet"]
    r = got(k.registrations)
    assert (r.version, r.endpoint, r.resource_name) == ("v1beta1", "convgpu.sock", "convgpu.io/gpu-memory")
    assert r.options.get_preferred_allocation_available and not r.options.pre_start_required
    first = got(k.lists)
    # 1 GiB / 256 MiB = 4 units on GPU0; 512 MiB + 100 B = 2 whole units on GPU1
    assert first == [(i, "Healthy") for i in ids(A, 4) + ids(B, 2)]
    assert k.options.get_preferred_allocation_available
    # the plugin counts a registration once its Register call returns, which may be after the
    # kubelet answered ListAndWatch (1 run in ~20 read 0 here)
    deadline = time.monotonic() + 10
    while plugin.registered < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert k.registrations.empty() and plugin.registered == 1


def test_capacity_change_reaches_the_kubelet_through_listandwatch(node):
    plugin, box = node
    k = box["kubelet"]
    got(k.registrations)
    assert len(got(k.lists)) == 6
    assert plugin.set_gpus([dv.Gpu(0, 768 * MiB, A)])       # GPU1 gone, GPU0 shares less
    assert got(k.lists) == [(i, "Healthy") for i in ids(A, 3)]
    assert not plugin.set_gpus([dv.Gpu(0, 768 * MiB + 5, A)])   # same units: nothing sent
    plugin.set_gpus(GPUS)
    assert got(k.lists) == [(i, "Healthy") for i in ids(A, 4) + ids(B, 2)]
    assert k.lists.empty()


def test_reregisters_when_the_kubelet_restarts(node):
    plugin, box = node
    k = box["kubelet"]
    got(k.registrations)
    got(k.lists)
    k2 = box["kubelet"] = k.restart()       # its socket and ours removed, a new kubelet.sock
    r = got(k2.registrations)
    assert (r.version, r.resource_name) == ("v1beta1", "convgpu.io/gpu-memory")
    assert got(k2.lists) == [(i, "Healthy") for i in ids(A, 4) + ids(B, 2)]   # served on a new socket
    k3 = box["kubelet"] = k2.restart()
    got(k3.registrations)
    deadline = time.monotonic() + 30  # the plugin counts a registration once its call returned (slow under load)
    while plugin.registered < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert plugin.registered == 3 and k3.registrations.empty()


def _preferred(stub, available, must, size):
    m, _ = api.deviceplugin()
    req = m.PreferredAllocationRequest(container_requests=[m.ContainerPreferredAllocationRequest(
        available_deviceIDs=available, must_include_deviceIDs=must, allocation_size=size)])
    return list(stub.GetPreferredAllocation(req, timeout=5).container_responses[0].deviceIDs)


def test_preferred_allocation_keeps_a_container_on_one_gpu(node):
    plugin, box = node
    k = box["kubelet"]
    got(k.registrations)
    got(k.lists)
    stub = k.plugin()
    every = ids(A, 4) + ids(B, 2)
    # 2 units: both GPUs can hold them; GPU1 has the fewest free (best fit), so it gets them
    assert _preferred(stub, every, [], 2) == ids(B, 2)
    # 3 units: only GPU0 can
    assert _preferred(stub, every, [], 3) == ids(A, 3)
    # a must-include id fixes the GPU
    assert _preferred(stub, every, [f"{A}::2"], 2) == [f"{A}::2", f"{A}::0"]
    # GPU0 partly taken: 2 free there, 2 on GPU1 -> the lower GPU on a tie
    assert _preferred(stub, ids(A, 4)[2:] + ids(B, 2), [], 2) == [f"{A}::2", f"{A}::3"]
    # 5 units fit on no GPU: the answer spans, the GPU with more free first
    assert _preferred(stub, every, [], 5) == ids(A, 4) + [f"{B}::0"]


def test_allocate_makes_the_gpu_visible_with_its_device_nodes(node, tmp_path):
    plugin, box = node
    k = box["kubelet"]
    got(k.registrations)
    got(k.lists)
    dev = tmp_path / "dev"
    dev.mkdir()
    for n in ("nvidia3", "nvidia0", "nvidiactl", "nvidia-uvm"):   # no uvm-tools, no modeset here
        (dev / n).touch()
    m, _ = api.deviceplugin()
    stub = k.plugin()
    resp = stub.Allocate(m.AllocateRequest(container_requests=[
        m.ContainerAllocateRequest(devices_ids=ids(B, 2)),
        m.ContainerAllocateRequest(devices_ids=ids(A, 3))]), timeout=5)
    one, two = resp.container_responses
    assert dict(one.envs) == {"NVIDIA_VISIBLE_DEVICES": B, "CONVGPU_GPU_MEMORY_LIMIT": str(512 * MiB)}
    assert [(d.container_path, d.host_path, d.permissions) for d in one.devices] == [
        ("/dev/nvidia3", str(dev / "nvidia3"), "rw"), ("/dev/nvidiactl", str(dev / "nvidiactl"), "rw"),
        ("/dev/nvidia-uvm", str(dev / "nvidia-uvm"), "rw")]
    assert [(x.container_path, x.host_path, x.read_only) for x in one.mounts] == [
        (f"/var/run/nvidia-container-devices/{B}", "/dev/null", True)]
    assert dict(two.envs) == {"NVIDIA_VISIBLE_DEVICES": A, "CONVGPU_GPU_MEMORY_LIMIT": str(768 * MiB)}
    assert two.devices[0].container_path == "/dev/nvidia0"
    assert [(g.units, [x.index for x in g.gpus]) for g in plugin.grants] == [(2, [1]), (3, [0])]
    with pytest.raises(grpc.RpcError) as e:
        stub.Allocate(m.AllocateRequest(container_requests=[m.ContainerAllocateRequest(devices_ids=[f"{A}::9"])]),
                      timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and f"{A}::9" in e.value.details()
    assert stub.PreStartContainer(m.PreStartContainerRequest(devices_ids=ids(A, 1)), timeout=5) == \
        m.PreStartContainerResponse()


def test_device_ids_without_uuid_and_spanning_allocation():
    g = [dv.Gpu(0, 512 * MiB), dv.Gpu(1, 512 * MiB, minor=7)]
    assert dv.device_ids(g, UNIT) == ["gpu0::0", "gpu0::1", "gpu1::0", "gpu1::1"]
    grant = dv.allocate(["gpu1::1", "gpu0::0"], g, UNIT, dev_root="/nonexistent")
    assert grant.envs["NVIDIA_VISIBLE_DEVICES"] == "0,1" and grant.devices == [] and grant.units == 2
    assert grant.mounts == [("/var/run/nvidia-container-devices/0", "/dev/null"),
                            ("/var/run/nvidia-container-devices/1", "/dev/null")]
    assert dv.preferred(["gpu0::1", "gpu1::0", "gpu1::1"], [], 2) == ["gpu1::0", "gpu1::1"]
    assert grant.shares == {"gpu0": UNIT, "gpu1": UNIT} and grant.cdi == ["nvidia.com/gpu=0", "nvidia.com/gpu=1"]


def test_allocate_offers_the_shim_read_only_and_health_is_per_gpu():
    shim = dv.ShimOffer("/run/convgpu/lib/libconvgpu.so", "/run/convgpu/shim")
    grant = dv.allocate(ids(A, 3) + ids(B, 1), GPUS, UNIT, "/nonexistent", shim, cdi_kind="")
    assert grant.shares == {A: 3 * UNIT, B: UNIT} and grant.cdi == []
    assert grant.envs["LD_PRELOAD"] == dv.SHIM_LIB and grant.envs["CONVGPU_SHIM_SOCKET"] == f"{dv.SHIM_DIR}/shim.sock"
    assert grant.mounts[-2:] == [(dv.SHIM_LIB, shim.lib), (dv.SHIM_DIR, shim.sock_dir)]
    assert "LD_PRELOAD" not in dv.allocate(ids(A, 1), GPUS, UNIT, "/nonexistent").envs
    assert dv.health(ids(A, 2) + ids(B, 2), {B}) == [(i, "Healthy") for i in ids(A, 2)] + \
        [(i, "Unhealthy") for i in ids(B, 2)]


def test_a_failing_gpu_read_does_not_end_the_agent(tmp_path):
    from convgpu.kube.agent import Agent
    reads = []

    def read():
        reads.append(1)
        if len(reads) == 1:
            raise OSError("NVML: GPU is lost")
        return GPUS
    plugin = DevicePlugin(str(tmp_path), GPUS[:1], UNIT)
    Agent(plugin, None, read, inventory_every=0.05, bad=lambda: {B}).run(duration=0.5)
    assert len(reads) >= 3 and plugin.gpus == GPUS and plugin.bad == {B}


def test_convgpu_kube_command_registers_and_lists(tmp_path):
    """The CLI as the DaemonSet runs it (no NVML here: one GPU of --gpu-memory), until SIGTERM."""
    import signal
    import subprocess
    import sys
    d = tmp_path / "device-plugins"
    d.mkdir()
    k = Kubelet(str(d)).start()
    p = subprocess.Popen([sys.executable, "-m", "convgpu.cli.main", "kube", "--gpu-memory", "1GiB", "--unit", "128MiB",
                          "--plugin-dir", str(d), "--api", "off", "--no-limits", "--run-dir", str(tmp_path / "run")],
                         stderr=subprocess.PIPE, text=True)
    try:
        r = got(k.registrations, 60)
        assert (r.endpoint, r.resource_name) == ("convgpu.sock", "convgpu.io/gpu-memory")
        assert got(k.lists) == [(f"gpu0::{i}", "Healthy") for i in range(8)]
    finally:
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=30)
        k.stop()
    assert p.returncode == 0, err
    assert "serving convgpu.io/gpu-memory: 8 units of 128MiB on 1 GPU(s)" in err
    assert not (d / "convgpu.sock").exists()


def test_doctor_kubernetes_section(tmp_path):
    from convgpu.kube import doctor
    d = tmp_path / "device-plugins"
    d.mkdir()
    prs = str(tmp_path / "pod-resources.sock")
    assert doctor.checks(str(d), prs) == [
        ("kubernetes", False, f"no kubelet sockets ({d}/kubelet.sock, {prs})",
         "only on a Kubernetes node: deploy with docs/KUBERNETES.md")]
    k = Kubelet(str(d), prs)
    pm, _ = api.podresources()
    k.pods = [pm.PodResources(namespace="ml", name="p", containers=[
        pm.ContainerResources(name="c", devices=[pm.ContainerDevices(resource_name=dv.RESOURCE, device_ids=ids(A, 2))]),
        pm.ContainerResources(name="d")])]
    k.start()
    plugin = DevicePlugin(str(d), GPUS, UNIT)
    try:
        got_ = {c[0]: c[1:] for c in doctor.checks(str(d), prs)}
        assert got_["kubelet device plugins"] == (True, f"{d}/kubelet.sock", "")
        assert not got_["convgpu.io/gpu-memory plugin"][0]            # not serving yet
        assert not got_["convgpu.io/gpu-memory registered"][0]
        assert got_["pods seen"] == (True, "1 pods, 1 containers with convgpu.io/gpu-memory (2 units)", "")
        assert plugin.check()
        (d / doctor.CHECKPOINT).write_text(json.dumps({"Data": {"PodDeviceEntries": None, "RegisteredDevices": {
            dv.RESOURCE: ids(A, 4) + ids(B, 2)}}, "Checksum": 1}))
        got_ = {c[0]: c[1:] for c in doctor.checks(str(d), prs)}
        assert got_["convgpu.io/gpu-memory plugin"] == (True, f"{d}/convgpu.sock: 6 units", "")
        assert got_["convgpu.io/gpu-memory registered"] == (True, "the kubelet's checkpoint lists 6 devices", "")
        plugin.set_health({GPUS[0].key})        # GPU 0's XID: its 4 units
        got_ = {c[0]: c[1:] for c in doctor.checks(str(d), prs, run_dir=str(tmp_path))}
        assert got_["convgpu.io/gpu-memory plugin"][:2] == (False, f"{d}/convgpu.sock: 6 units, 4 unhealthy")
        assert got_["enforcer"][0] is False and got_["enforcer"][1].startswith(f"{tmp_path}/control.sock: ")
    finally:
        plugin.close()
        k.stop()


def test_agent_rereads_the_inventory_and_survives_a_failing_sync(tmp_path):
    from convgpu.kube.agent import Agent
    d = tmp_path / "device-plugins"
    d.mkdir()
    k = Kubelet(str(d)).start()
    inventories = [GPUS, [GPUS[0]]]     # then GPU1 is gone for good

    class Sync:
        rounds = 0

        def round(self):
            Sync.rounds += 1
            raise OSError("enforcer restarting")

    agent = Agent(DevicePlugin(str(d), GPUS, UNIT), Sync(),
                  lambda: inventories.pop(0) if len(inventories) > 1 else inventories[0],
                  sync_every=0.05, inventory_every=0.3)
    t = threading.Thread(target=agent.run, daemon=True)
    t.start()
    try:
        got(k.registrations)
        assert len(got(k.lists)) == 6
        assert got(k.lists) == [(i, "Healthy") for i in ids(A, 4)]    # the second reading: GPU1 gone
        assert Sync.rounds >= 2 and t.is_alive()
    finally:
        agent.stop.set()
        t.join(timeout=10)
        k.stop()
    assert not t.is_alive() and not (d / "convgpu.sock").exists()


def test_a_refused_registration_is_retried(tmp_path):
    """A registration that fails (a stale kubelet.sock nobody serves) is tried again at the next
    check; once a kubelet takes it, it is not repeated while that kubelet lives."""
    import socket
    d = tmp_path / "device-plugins"
    d.mkdir()
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(d / "kubelet.sock"))        # the file of a dead kubelet: connection refused
    plugin = DevicePlugin(str(d), GPUS, UNIT)
    try:
        assert not plugin.check() and not plugin.check() and plugin.registered == 0
        stale.close()
        os.unlink(d / "kubelet.sock")
        k = Kubelet(str(d)).start()
        deadline = time.monotonic() + 10    # a kubelet just started may refuse one connection too
        while not plugin.check() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert plugin.registered == 1
        assert plugin.check() and plugin.registered == 1      # same kubelet: not again
        got(k.registrations)
        assert len(got(k.lists)) == 6
        k.stop()
    finally:
        plugin.close()


def test_a_failing_sync_is_one_line_said_once_and_backs_off(tmp_path, caplog):
    """Issue 52: plain `convgpu kube` on a host with no kubelet logged a raw multi-line
    _InactiveRpcError every 2 s. One line (its code and details), said once while the reason is
    the same, the rounds spaced out while it fails."""
    import logging
    from convgpu.kube.agent import Agent
    caplog.set_level(logging.INFO, logger="convgpu")

    class Unavailable(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.UNAVAILABLE

        def details(self):
            return "failed to connect to all addresses"

        def __str__(self):
            return "<_InactiveRpcError of RPC that terminated with:\n\tstatus = StatusCode.UNAVAILABLE\n\tdetails = ..."

    class Sync:
        rounds = 0

        def round(self):
            Sync.rounds += 1
            raise Unavailable()

    d = tmp_path / "device-plugins"
    d.mkdir()
    Agent(DevicePlugin(str(d), GPUS, UNIT), Sync(), lambda: GPUS, sync_every=0.05, inventory_every=10).run(duration=1.0)
    said = [r.getMessage() for r in caplog.records if "limits not synced" in r.getMessage()]
    assert said == ["limits not synced: UNAVAILABLE: failed to connect to all addresses; trying again, less often "
                    "while it fails (up to every 60 s)"]
    assert 2 <= Sync.rounds <= 5     # 0, 0.1, 0.3, 0.7 s: not every 0.05 s (20 rounds)


def test_kube_dra_on_a_host_that_is_no_node_makes_nothing_and_names_no_extra_it_has(short_tmp, monkeypatch):
    """Issue 52: `kube --dra` left /var/lib/kubelet/plugins* behind on a host that is not a node,
    and suggested `pip install 'convgpu[k8s]'` where it was installed. Without a kubelet's dir it
    refuses and makes nothing; with one but no API server, the fix is the configuration; and the
    plugin removes at its close the directories it made."""
    from typer.testing import CliRunner
    from convgpu.cli.main import app
    from convgpu.kube.dra import CdiDir, DraPlugin, Enforcer
    tmp_path = short_tmp     # the plugin's sockets: a UNIX socket's path holds 107 bytes
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "none"))
    base = ["kube", "--dra", "--gpu-memory", "4GiB", "--node-name", "n1", "--api", "off", "--no-shim",
            "--run-dir", str(tmp_path / "run"), "--cdi-dir", str(tmp_path / "cdi")]
    kubelet = tmp_path / "kubelet"
    r = CliRunner().invoke(app, base + ["--registry-dir", str(kubelet / "plugins_registry"),
                                        "--plugins-dir", str(kubelet / "plugins")])
    assert r.exit_code == 1 and r.output.strip() == (
        f"convgpu: no kubelet on this host: {kubelet} is missing; run `convgpu kube --dra` on a Kubernetes node (the "
        "DaemonSet does), or give --registry-dir"), r.output
    assert not kubelet.exists()
    kubelet.mkdir()
    r = CliRunner().invoke(app, base + ["--registry-dir", str(kubelet / "plugins_registry"),
                                        "--plugins-dir", str(kubelet / "plugins")])
    assert r.exit_code == 1 and "--dra needs the API server" in r.output and "pip install" not in r.output, r.output
    p = DraPlugin("n1", GPUS, None, Enforcer(str(tmp_path / "none.sock")), CdiDir(str(tmp_path / "cdi")),
                  str(kubelet / "plugins_registry"), str(kubelet / "plugins"))
    p.serve()
    assert (kubelet / "plugins" / "gpu-memory.convgpu.io").is_dir() and (kubelet / "plugins_registry").is_dir()
    p.close()
    assert sorted(os.listdir(kubelet)) == []
