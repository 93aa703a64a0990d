"""Issue 40: the DRA kubelet plugin on a real enforcer (stand-in driver, real cgroups laid out as
the kubelet lays them out), the test-side kubelet speaking plugin registration and the DRAPlugin
services over gRPC, and an API-server double that the `kubernetes` client talks to over HTTP.
Two pods whose claims hold 1 GiB and 3 GiB of one 4 GiB GPU are each held exactly to their
claim; Prepare is idempotent and one claim's error touches nothing else; a plugin killed -9
between Prepare and the container's first CUDA call (and an enforcer restarted then) leaves the
limit in force."""
import json
import os
import signal
import subprocess
import sys

import pytest

from apiserver_double import ApiServer, claim
from conftest import GiB, MiB, inprocess_enforcer, read_until, serving, start_in, until, wait_state
from convgpu.kube import api, devices as dv
from convgpu.kube.dra import CdiDir, DraPlugin, Enforcer
from kubelet_side import DraKubelet

pytestmark = pytest.mark.system
DRIVER, NODE = "gpu-memory.convgpu.io", "node-a"
UID_A, UID_B = "da0a0a0a-1111-2222-3333-444444444444", "db0b0b0b-5555-6666-7777-888888888888"
CID_A, CID_B = "a4" * 32, "b5" * 32
CLAIM_A, CLAIM_B = "c1a1a1a1-0000-4000-8000-00000000000a", "c2b2b2b2-0000-4000-8000-00000000000b"


def _status(enf) -> dict:
    """`status`'s rows by id, and by the id of each container they hold (a claim's budget is one
    row, its consumers listed in it)."""
    from convgpu.enforcer.serving.server import request
    rows = request(enf.control_path, {"cmd": "status"})["status"]["containers"]
    return {k: r for r in rows for k in (r["id"], *(m["id"] for m in r["consumers"]))}


def _plugin(short_tmp, srv, enf, gpus=None) -> DraPlugin:
    from kubernetes.client import ResourceV1Api
    from convgpu.kube.slices import Slices
    client = srv.client()
    return DraPlugin(NODE, gpus or [dv.Gpu(0, 4 * GiB)],
                     lambda ns, name: ResourceV1Api(client).read_namespaced_resource_claim(name, ns),
                     Enforcer(enf.control_path), CdiDir(str(short_tmp / "cdi")), str(short_tmp / "registry"),
                     str(short_tmp / "plugins"), slices=Slices(client, NODE, 256 * MiB), dev_root=str(short_tmp / "dev"))


def _agent(short_tmp, env, *args):
    """`convgpu kube --dra` as the DaemonSet runs it, its log in a file (a pipe nobody reads fills)."""
    with open(short_tmp / "agent.log", "a") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "convgpu.cli.main", "kube", "--dra", "--node-name", NODE, "--api", "off",
             "--registry-dir", str(short_tmp / "registry"), "--plugins-dir", str(short_tmp / "plugins"),
             "--cdi-dir", str(short_tmp / "cdi"), "--no-shim", "--pod-resources", str(short_tmp / "none.sock"),
             "--log-root", str(short_tmp / "log"), *args], stderr=log, text=True, env=env)


def _pod(cgroups, uid, cid):
    return cgroups(f"kubepods/besteffort/pod{uid}/{cid}")


def test_two_claims_on_one_gpu_each_held_to_its_claim(root, build, cgroups, caller_env, short_tmp):
    from convgpu.kube.drasync import ClaimSync
    from convgpu.kube.pods import KubeletLogPods
    # the enforcer counts 5 GiB, the slice publishes 4 (the plugin's --gpu-memory): room for A to
    # go on past its claim once the claim ends, beside B's 3 GiB; the default limit is that 5 GiB
    enf = inprocess_enforcer(build / "standin" / "libcuda.so.1", "dra", 5 * GiB, capacity={0: 5 * GiB})
    srv = ApiServer().start()
    srv.put_claim(claim("ml", "train-gpu", CLAIM_A, [("train", UID_A)], [("gpu", "gpu-0", "1Gi", "5a")]))
    srv.put_claim(claim("ml", "serve-gpu", CLAIM_B, [("serve", UID_B)], [("gpu", "gpu-0", "3Gi", "5b")]))
    (short_tmp / "dev").mkdir()
    (short_tmp / "dev" / "nvidia0").touch()       # the GPU's node as the CDI spec names it
    m, _ = api.podresources()
    kubelet = DraKubelet(str(short_tmp / "registry"), pod_resources=str(short_tmp / "pr.sock"))
    a = b = None
    try:
        with serving(enf):
            plugin = _plugin(short_tmp, srv, enf)
            plugin.serve()
            kubelet.start()
            info, chosen = kubelet.registrations.get(timeout=10)
            assert (info.type, info.name, list(info.supported_versions), chosen) == (
                "DRAPlugin", DRIVER, ["v1.DRAPlugin", "v1beta1.DRAPlugin"], "v1.DRAPlugin")
            assert info.endpoint == str(short_tmp / "plugins" / DRIVER / "dra.sock") and plugin.registered == 1
            # the slice: one shareable device, its memory the card's, in steps of the unit
            dev = srv.slices[f"{NODE}-{DRIVER}"]["spec"]["devices"][0]
            assert (dev["name"], dev["allowMultipleAllocations"], dev["capacity"]["memory"]) == (
                "gpu-0", True, {"value": "4Gi", "requestPolicy": {
                    "default": "4Gi", "validRange": {"min": "256Mi", "max": "4Gi", "step": "256Mi"}}})
            got = kubelet.prepare(DRIVER, [("ml", CLAIM_A, "train-gpu"), ("ml", CLAIM_B, "serve-gpu")])
            assert {u: r.error for u, r in got.items()} == {CLAIM_A: "", CLAIM_B: ""}
            d = got[CLAIM_A].devices[0]
            assert (list(d.request_names), d.pool_name, d.device_name, d.share_id, list(d.cdi_device_ids)) == (
                ["gpu"], NODE, "gpu-0", "5a", [f"convgpu.io/claim={CLAIM_A}-gpu-0", "nvidia.com/gpu=0"])
            spec = json.loads((short_tmp / "cdi" / f"convgpu-claim-{CLAIM_A}.json").read_text())
            assert spec["devices"] == [{"name": f"{CLAIM_A}-gpu-0", "containerEdits": {
                "env": ["NVIDIA_VISIBLE_DEVICES=void"],
                "deviceNodes": [{"path": "/dev/nvidia0", "hostPath": str(short_tmp / "dev" / "nvidia0")}]}}]
            assert "CONVGPU_GPU_MEMORY_LIMIT=1073741824" in spec["containerEdits"]["env"]

            # each pod asks a step past its claim: held with exactly its claim in use
            a = start_in(_pod(cgroups, UID_A, CID_A), build, caller_env, "alloc", "-n", 5, "-s", 256 * MiB, "--hold")
            b = start_in(_pod(cgroups, UID_B, CID_B), build, caller_env, "alloc", "-n", 13, "-s", 256 * MiB, "--hold")
            wait_state(a.pid, "T")
            wait_state(b.pid, "T")
            until(lambda: all(_status(enf).get(c, {}).get("over_limit_events") == 1 for c in (CID_A, CID_B)), 10,
                  "both over their claims")
            st = _status(enf)
            assert [(st[c]["limit"], st[c]["source"], st[c]["gpus"]["0"]["used"]) for c in (CID_A, CID_B)] == [
                (GiB, "DRA claim ml/train-gpu", GiB), (3 * GiB, "DRA claim ml/serve-gpu", 3 * GiB)]

            # the kubelet says which container uses which claim: matched, the same limits
            logs = short_tmp / "log" / "containers"
            logs.mkdir(parents=True)
            for pod, c, cid in (("train", "t", CID_A), ("serve", "s", CID_B)):
                (logs / f"{pod}_ml_{c}-{cid}.log").symlink_to("/nonexistent")
            kubelet.pods = [m.PodResources(namespace="ml", name=pod, containers=[m.ContainerResources(
                name=c, dynamic_resources=[m.DynamicResource(claim_name=n, claim_namespace="ml", claim_resources=[
                    m.ClaimResource(driver_name=DRIVER, pool_name=NODE, device_name="gpu-0")])])])
                for pod, c, n in (("train", "t", "train-gpu"), ("serve", "s", "serve-gpu"))]
            sync = ClaimSync(plugin.enforcer, [KubeletLogPods(str(short_tmp / "log"))], str(short_tmp / "pr.sock"))
            assert sync.round() == {CLAIM_A: {"containers": [CID_A], "users": []},
                                    CLAIM_B: {"containers": [CID_B], "users": []}}
            assert enf.rules.claims[CLAIM_A].containers == (CID_A,)
            assert (_status(enf)[CID_A]["limit"], _status(enf)[CID_B]["limit"]) == (GiB, 3 * GiB)

            # Unprepare ends the claim's decision: A falls back to the default and runs on
            got = kubelet.unprepare(DRIVER, [("ml", CLAIM_A, "train-gpu")])
            assert got[CLAIM_A].error == "" and sorted(enf.rules.claims) == [CLAIM_B]
            assert f"allocated 5 {5 * 256 * MiB} pid={a.pid}" in read_until(a, "ready")
            assert not (short_tmp / "cdi" / f"convgpu-claim-{CLAIM_A}.json").exists()
            assert _status(enf)[CID_B]["gpus"]["0"]["used"] == 3 * GiB     # B still held at its claim
            plugin.close()
    finally:
        for p in (a, b):
            if p is not None:
                p.kill()
                p.wait()
        kubelet.stop()
        srv.stop()


def test_prepare_is_idempotent_and_each_claim_has_its_own_error(root, build, short_tmp):
    """One Prepare with a good claim and four it cannot honour (a size past the card, no capacity
    result, a GPU that was lost, an object the client cannot read): the good one is prepared,
    each other gets one line, and nothing else is kept. Again: the same answer, nothing written.
    A v1beta1-only kubelet is served too, and a restarted kubelet registers the plugin again."""
    enf = inprocess_enforcer(build / "standin" / "libcuda.so.1", "dra-errors", 4 * GiB,
                             capacity={0: 4 * GiB, 1: 4 * GiB})
    srv = ApiServer().start()
    ok = ("ml", "0a000000-0000-4000-8000-000000000001", "ok")
    big = ("ml", "0a000000-0000-4000-8000-000000000002", "big")
    none = ("ml", "0a000000-0000-4000-8000-000000000003", "no-capacity")
    lost = ("ml", "0a000000-0000-4000-8000-000000000004", "on-lost-gpu")
    bad = ("ml", "0a000000-0000-4000-8000-000000000005", "malformed")
    pod = [("p", UID_A)]
    srv.put_claim(claim(*ok[:1], ok[2], ok[1], pod, [("gpu", "gpu-0", "1536Mi", None)]))
    srv.put_claim(claim(*big[:1], big[2], big[1], pod, [("gpu", "gpu-0", "5Gi", None)]))
    srv.put_claim(claim(*none[:1], none[2], none[1], pod, [("gpu", "gpu-0", None, None)]))
    srv.put_claim(claim(*lost[:1], lost[2], lost[1], pod, [("gpu", "gpu-1", "1Gi", None)]))
    srv.put_claim(claim(*bad[:1], bad[2], bad[1], pod, [("gpu", "gpu-0", "1Gi", None)]),
                  raw=json.dumps({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                                  "metadata": {"name": "malformed", "namespace": "ml", "uid": bad[1]},
                                  "status": {"allocation": {"devices": {"results": "everything"}}}}).encode())
    kubelet = DraKubelet(str(short_tmp / "registry"), versions=("v1beta1.DRAPlugin",))
    try:
        with serving(enf):
            plugin = _plugin(short_tmp, srv, enf, [dv.Gpu(0, 4 * GiB), dv.Gpu(1, 4 * GiB)])
            plugin.serve()
            kubelet.start()
            assert kubelet.registrations.get(timeout=10)[1] == "v1beta1.DRAPlugin"
            assert kubelet.health.get(timeout=10) == [("gpu-0", "HEALTHY"), ("gpu-1", "HEALTHY")]
            plugin.set_health({"gpu1"})                      # GPU 1 lost: withdrawn, reported
            assert kubelet.health.get(timeout=10) == [("gpu-0", "HEALTHY"), ("gpu-1", "UNHEALTHY")]
            assert [d["name"] for d in srv.slices[f"{NODE}-{DRIVER}"]["spec"]["devices"]] == ["gpu-0"]
            assert srv.slices[f"{NODE}-{DRIVER}"]["spec"]["pool"]["generation"] == 2
            claims = [ok, big, none, lost, bad]
            first = kubelet.prepare(DRIVER, claims)
            errors = {u: r.error for u, r in first.items()}
            assert errors[ok[1]] == "" and [d.device_name for d in first[ok[1]].devices] == ["gpu-0"]
            assert errors[big[1]] == ("claim ml/big request 'gpu': consumedCapacity.memory 5Gi is past GPU gpu0's "
                                      f"{4 * GiB} bytes")
            assert errors[none[1]].startswith("claim ml/no-capacity request 'gpu': no consumedCapacity.memory")
            assert errors[lost[1]] == ("claim ml/on-lost-gpu request 'gpu': device 'gpu-1' is not a GPU this node "
                                       "has now (lost?); it has gpu-0")
            assert errors[bad[1]].startswith("claim ml/malformed cannot be read: ")
            assert all("\n" not in e for e in errors.values())
            assert list(enf.rules.claims) == [ok[1]] and enf.rules.claims[ok[1]].gpus == (("gpu0", 1536 * MiB),)
            assert sorted(os.listdir(short_tmp / "cdi")) == [f"convgpu-claim-{ok[1]}.json"]
            writes = enf.durable.writes
            again = kubelet.prepare(DRIVER, claims)
            assert again == first and enf.durable.writes == writes   # the same answer, nothing written
            kubelet = kubelet.restart()                      # a kubelet restart: registered again
            assert kubelet.registrations.get(timeout=10)[1] == "v1beta1.DRAPlugin"
            assert kubelet.unprepare(DRIVER, [ok, ok])[ok[1]].error == ""
            assert enf.rules.claims == {} and os.listdir(short_tmp / "cdi") == []
            from convgpu.kube import doctor      # `convgpu doctor` on a DRA node: the plugin and the enforcer
            got = doctor.checks(registry_dir=str(short_tmp / "registry"), run_dir=enf.run_dir)
            assert [(name, ok) for name, ok, _, _ in got] == [(f"DRA driver {DRIVER}", True), ("enforcer", True)]
            assert "services v1.DRAPlugin, v1beta1.DRAPlugin" in got[0][2]
            plugin.close()
    finally:
        kubelet.stop()
        srv.stop()


def test_a_claim_the_enforcer_refuses_leaves_no_cdi_spec(root, build, short_tmp):
    """The plugin's slice says 8 GiB where the enforcer counts 4 GiB (a --reserve given to one
    of them): a 6 GiB claim passes the plugin's own checks, its CDI spec is written, and the
    enforcer refuses it. The kubelet gets the enforcer's one line, and the spec is gone (a spec
    left behind names a shim and a GPU for a claim no limit holds); a 1 GiB claim in the same
    call is prepared and keeps its spec."""
    enf = inprocess_enforcer(build / "standin" / "libcuda.so.1", "dra-refused", 4 * GiB)
    srv = ApiServer().start()
    big, ok = ("ml", CLAIM_A, "big"), ("ml", CLAIM_B, "ok")
    srv.put_claim(claim("ml", "big", CLAIM_A, [("p", UID_A)], [("gpu", "gpu-0", "6Gi", None)]))
    srv.put_claim(claim("ml", "ok", CLAIM_B, [("p", UID_B)], [("gpu", "gpu-0", "1Gi", None)]))
    kubelet = DraKubelet(str(short_tmp / "registry"))
    try:
        with serving(enf):
            plugin = _plugin(short_tmp, srv, enf, [dv.Gpu(0, 8 * GiB)])
            plugin.serve()
            kubelet.start()
            assert kubelet.registrations.get(timeout=10)[1] == "v1.DRAPlugin"
            got = kubelet.prepare(DRIVER, [big, ok])
            assert got[CLAIM_A].error == ("claim ml/big: 6.0 GiB on GPU gpu0 would put its claims at 6.0 GiB, past its "
                                          "4.0 GiB; the ResourceSlice's capacity is more than the enforcer's: give both "
                                          "the same --reserve / --gpu-memory"), got[CLAIM_A].error
            assert got[CLAIM_B].error == ""
            assert list(enf.rules.claims) == [CLAIM_B]
            assert sorted(os.listdir(short_tmp / "cdi")) == [f"convgpu-claim-{CLAIM_B}.json"]
            plugin.close()
    finally:
        kubelet.stop()
        srv.stop()


def test_a_plugin_killed_after_prepare_and_an_enforcer_restart_keep_the_limit(root, build, cgroups, caller_env,
                                                                           short_tmp):
    """`convgpu kube --dra` as the DaemonSet runs it (a subprocess, KUBECONFIG naming the double)
    prepares a 1 GiB claim and is killed -9 before the pod's first CUDA call; the enforcer is
    then stopped and started again on its state dir. The pod is held at its claim all the same."""
    enf = inprocess_enforcer(build / "standin" / "libcuda.so.1", "dra-kill", 4 * GiB)
    srv = ApiServer().start()
    srv.put_claim(claim("ml", "c", CLAIM_A, [("p", UID_A)], [("gpu", "gpu-0", "1Gi", None)]))
    kubelet = DraKubelet(str(short_tmp / "registry"))
    env = dict(os.environ, KUBECONFIG=srv.kubeconfig(short_tmp / "kubeconfig"))
    a = agent = None
    try:
        with serving(enf):
            agent = _agent(short_tmp, env, "--gpu-memory", "4GiB", "--run-dir", enf.run_dir)
            kubelet.start()
            assert kubelet.registrations.get(timeout=60)[1] == "v1.DRAPlugin"
            assert kubelet.prepare(DRIVER, [("ml", CLAIM_A, "c")])[CLAIM_A].error == ""
            agent.send_signal(signal.SIGKILL)
            agent.wait(timeout=10)
        enf2 = inprocess_enforcer(build / "standin" / "libcuda.so.1", "dra-kill-2", 4 * GiB, state_dir=enf.run_dir)
        with serving(enf2):
            assert sorted(enf2.rules.claims) == [CLAIM_A]
            a = start_in(_pod(cgroups, UID_A, CID_A), build, caller_env, "alloc", "-n", 5, "-s", 256 * MiB, "--hold")
            wait_state(a.pid, "T")
            until(lambda: _status(enf2).get(CID_A, {}).get("over_limit_events") == 1, 10, "over its claim")
            row = _status(enf2)[CID_A]
            assert (row["limit"], row["source"], row["gpus"]["0"]["used"]) == (GiB, "DRA claim ml/c", GiB)
    finally:
        if a is not None:
            a.kill()
            a.wait()
        if agent is not None and agent.poll() is None:
            agent.kill()
            agent.wait()
        kubelet.stop()
        srv.stop()


def test_the_slice_is_each_card_less_the_reserve_and_a_lost_gpu_leaves_it(build, short_tmp):
    """`convgpu kube --dra` over the stand-in NVML (two GPUs of 4 GiB): the slice publishes each
    GPU by its uuid with NVML's facts and the card less --reserve; a GPU lost to NVML leaves the
    slice (a new pool generation) and the health stream says it is unhealthy."""
    from kubelet_side import Node
    node = Node(build, short_tmp, gpus=2, capacity=4 * GiB)
    srv = ApiServer().start()
    kubelet = DraKubelet(str(short_tmp / "registry"))
    env = dict(os.environ, **node.env, KUBECONFIG=srv.kubeconfig(short_tmp / "kubeconfig"))
    agent = _agent(short_tmp, env, "--reserve", "512MiB", "--run-dir", str(short_tmp / "run"), "--inventory-every", "0.2")
    names = [f"gpu-{u.lower().removeprefix('gpu-')}" for u in node.uuids]
    try:
        kubelet.start()
        assert kubelet.registrations.get(timeout=60)[1] == "v1.DRAPlugin"
        assert kubelet.health.get(timeout=10) == [(names[0], "HEALTHY"), (names[1], "HEALTHY")]
        spec = srv.slices[f"{NODE}-{DRIVER}"]["spec"]
        assert [d["name"] for d in spec["devices"]] == names and spec["pool"]["generation"] == 1
        d = spec["devices"][1]
        assert d["capacity"]["memory"] == {"value": "3584Mi", "requestPolicy": {
            "default": "3584Mi", "validRange": {"min": "256Mi", "max": "3584Mi", "step": "256Mi"}}}
        assert d["attributes"] == {"index": {"int": 1}, "convgpuVersion": {"version": "0.1.0"},
                                   "uuid": {"string": node.uuids[1]}, "model": {"string": "Stand-in GPU"},
                                   "architecture": {"string": "Hopper"}, "driverVersion": {"string": "580.0-standin"}}
        node.lose(1)
        assert kubelet.health.get(timeout=10) == [(names[0], "HEALTHY"), (names[1], "UNHEALTHY")]
        until(lambda: [d["name"] for d in srv.slices[f"{NODE}-{DRIVER}"]["spec"]["devices"]] == names[:1], 10,
              "the lost GPU withdrawn")
        assert srv.slices[f"{NODE}-{DRIVER}"]["spec"]["pool"]["generation"] == 2
    finally:
        agent.terminate()
        agent.wait(timeout=30)
        kubelet.stop()
        srv.stop()
    assert agent.returncode == 0
