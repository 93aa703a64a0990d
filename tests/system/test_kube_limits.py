"""A pod-resources listing turned into limits that a running enforcer applies: the test-side
kubelet answers List (gRPC), the agent's PodSync resolves container ids from the kubelet's log
links and pod uids from its pod log dirs, and sends the limits over the control socket to an
enforcer on the stand-in driver. The callers run in real cgroups laid out as the kubelet lays
them out: a Burstable pod under the systemd driver (cri-containerd scope) and a BestEffort pod
under the cgroupfs driver (bare container id)."""
import pytest

from conftest import GiB, MiB, inprocess_enforcer, read_until, serving, start_in, until, wait_state
from convgpu.kube import api
from convgpu.kube.pods import KubeletLogPods, PodSync
from kubelet_side import Kubelet

pytestmark = pytest.mark.system
UNIT = 256 * MiB
UID_A, UID_B = "0a0a0a0a-1111-2222-3333-444444444444", "0b0b0b0b-5555-6666-7777-888888888888"
CID_A, CID_B = "a1" * 32, "b2" * 32


def _pods(m, units_a):
    def one(name, container, n):
        return m.PodResources(namespace="ml", name=name, containers=[m.ContainerResources(name=container, devices=[
            m.ContainerDevices(resource_name="convgpu.io/gpu-memory", device_ids=[f"gpu0::{i}" for i in range(n)])])])
    return [one("trainer", "train", units_a), one("server", "infer", 8)]


def _status(enf):
    from convgpu.enforcer.serving.server import request
    return {c["id"]: c for c in request(enf.control_path, {"cmd": "status"})["status"]["containers"]}


def test_a_pod_over_its_units_stalls_one_within_them_runs(root, build, cgroups, caller_env, tmp_path):
    # the enforcer's own default is the whole card: only the pods' units can stall anyone
    enf = inprocess_enforcer(build / "standin" / "libcuda.so.1", "kube", 4 * GiB)
    cg_a = cgroups("kubepods.slice/kubepods-burstable.slice/"
                   f"kubepods-burstable-pod{UID_A.replace('-', '_')}.slice/cri-containerd-{CID_A}.scope")
    cg_b = cgroups(f"kubepods/besteffort/pod{UID_B}/{CID_B}")
    logs = tmp_path / "log"
    (logs / "pods" / f"ml_trainer_{UID_A}").mkdir(parents=True)
    (logs / "pods" / f"ml_server_{UID_B}").mkdir(parents=True)     # its container not linked yet
    (logs / "containers").mkdir()
    (logs / "containers" / f"trainer_ml_train-{CID_A}.log").symlink_to("/nonexistent")
    plugins = tmp_path / "device-plugins"
    plugins.mkdir()
    kubelet = Kubelet(str(plugins), str(tmp_path / "pod-resources.sock"))
    m, _ = api.podresources()
    kubelet.pods = _pods(m, 2)
    kubelet.start()
    a = b = None
    try:
        with serving(enf):
            sync = PodSync(enf.control_path, [KubeletLogPods(str(logs))], UNIT, str(tmp_path / "pod-resources.sock"))
            sent = sync.round()
            assert {k: v[:2] for k, v in sent.items()} == {
                CID_A: (512 * MiB, "pod ml/trainer train: 2 x 256 MiB convgpu.io/gpu-memory"),
                UID_A: (512 * MiB, "pod ml/trainer train: 2 x 256 MiB convgpu.io/gpu-memory"),
                UID_B: (2 * GiB, "pod ml/server infer: 8 x 256 MiB convgpu.io/gpu-memory")}
            assert enf.rules.pods == sent

            a = start_in(cg_a, build, caller_env, "alloc", "-n", 3, "-s", 256 * MiB, "--hold")
            b = start_in(cg_b, build, caller_env, "alloc", "-n", 3, "-s", 256 * MiB, "--hold")
            lines = read_until(b, "ready")              # 768 MiB within its 2 GiB: runs
            assert f"allocated 3 {768 * MiB} pid={b.pid}" in lines
            wait_state(a.pid, "T")                      # its third 256 MiB is over 512 MiB: stopped
            until(lambda: _status(enf).get(CID_A, {}).get("over_limit_events") == 1, 10, "A over its limit")
            st = _status(enf)
            assert (st[CID_A]["kind"], st[CID_A]["limit"], st[CID_A]["source"]) == \
                ("kubernetes", 512 * MiB, "pod ml/trainer train: 2 x 256 MiB convgpu.io/gpu-memory")
            assert st[CID_A]["gpus"]["0"]["used"] == 512 * MiB and st[CID_A]["gpus"]["0"]["waiting"]
            assert (st[CID_B]["kind"], st[CID_B]["limit"], st[CID_B]["gpus"]["0"]["used"]) == \
                ("kubernetes", 2 * GiB, 768 * MiB)

            kubelet.pods = _pods(m, 4)                  # the pod's grant grows to 1 GiB: it resumes
            assert sync.round()[CID_A][0] == GiB
            lines = read_until(a, "ready")
            assert f"allocated 3 {768 * MiB} pid={a.pid}" in lines
            assert _status(enf)[CID_A]["limit"] == GiB
            for p in (a, b):
                p.stdin.write("\n")
                p.stdin.flush()
                read_until(p, "exit")
                assert p.wait(timeout=20) == 0
    finally:
        for p in (a, b):
            if p and p.poll() is None:
                p.kill()
                p.wait()
        kubelet.stop()


def test_the_daemonsets_two_commands_together(root, build, cgroups, caller_env, tmp_path):
    """`convgpu enforce` and `convgpu kube` as the DaemonSet runs them (subprocesses, one run
    dir): the agent registers with the kubelet, lists the pods, and the enforcer stalls the pod
    that goes over its units."""
    import subprocess
    import sys
    from conftest import Enforcing, lines_until
    plugins = tmp_path / "device-plugins"
    plugins.mkdir()
    (tmp_path / "log" / "containers").mkdir(parents=True)
    (tmp_path / "log" / "containers" / f"trainer_ml_train-{CID_A}.log").symlink_to("/nonexistent")
    kubelet = Kubelet(str(plugins), str(tmp_path / "pod-resources.sock"))
    m, _ = api.podresources()
    kubelet.pods = _pods(m, 2)
    kubelet.start()
    enf = Enforcing(build, "--gpu-memory", "4GiB", "--default-limit", "4GiB", "--policy", "fifo")
    agent = subprocess.Popen([sys.executable, "-m", "convgpu.cli.main", "kube", "--gpu-memory", "4GiB",
                              "--plugin-dir", str(plugins), "--pod-resources", str(tmp_path / "pod-resources.sock"),
                              "--api", "off", "--log-root", str(tmp_path / "log"), "--run-dir", enf.run_dir,
                              "--sync", "0.2"], stderr=subprocess.PIPE, text=True)
    a = None
    try:
        r = kubelet.registrations.get(timeout=60)
        assert r.resource_name == "convgpu.io/gpu-memory"
        assert kubelet.lists.get(timeout=10) == [(f"gpu0::{i}", "Healthy") for i in range(16)]
        lines_until(agent.stderr, lambda line: "pod limits: 1 container(s) and pod(s) sent" in line, [], 30, "agent")
        enf.wait_for("pod limits: 1 keys")
        a = start_in(cgroups("kubepods.slice/kubepods-burstable.slice/"
                             f"kubepods-burstable-pod{UID_A.replace('-', '_')}.slice/cri-containerd-{CID_A}.scope"),
                     build, caller_env, "alloc", "-n", 3, "-s", 256 * MiB, "--hold")
        wait_state(a.pid, "T")
        enf.wait_for("above its limit 512.0 MiB")
        st = {c["id"]: c for c in enf.ctl(cmd="status")["status"]["containers"]}
        assert (st[CID_A]["limit"], st[CID_A]["source"], st[CID_A]["gpus"]["0"]["used"]) == \
            (512 * MiB, "pod ml/trainer train: 2 x 256 MiB convgpu.io/gpu-memory", 512 * MiB)
    finally:
        if a is not None:
            a.kill()
            a.wait()
        agent.terminate()
        agent.wait(timeout=30)
        assert enf.stop() == 0
        kubelet.stop()
    assert agent.returncode == 0
