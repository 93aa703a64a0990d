"""Issue 48: a DRA claim is one budget, the way the scheduler counted it, for every consumer of
it. On the stand-in driver, with a real enforcer, the DRA plugin served over gRPC to the
test-side kubelet (tests/kubelet_side.py) and claims read from the API-server double over HTTP,
and every pod's cgroup laid out as the kubelet's systemd driver lays it out
(kubepods.slice/kubepods-<qos>.slice/kubepods-<qos>-pod<uid>.slice/cri-containerd-<id>.scope):
- two pods on one shared 2 GiB claim are together held to 2 GiB (the second pod is known only
  from the kubelet's pod-resources API: the kubelet prepares a claim once), stalled together
  (the freezer holds both pods' containers), and shown as one row with both consumers;
- two containers of one pod on one 1 GiB claim are together held to 1 GiB;
- a container on a two-GPU node gets 0 on the GPU its claim does not name;
- an adminAccess claim is prepared on a full GPU and charges nothing."""
import json

import pytest

from apiserver_double import ApiServer, claim
from conftest import GiB, MiB, inprocess_enforcer, need, read_until, serving, start_in, until, wait_state
from convgpu.kube import api, devices as dv
from convgpu.kube.dra import CdiDir, DraPlugin, Enforcer
from kubelet_side import DraKubelet

pytestmark = pytest.mark.system
DRIVER, NODE, NS = "gpu-memory.convgpu.io", "node-a", "team"
P1, P2 = "a1a1a1a1-1111-4111-8111-111111111111", "b2b2b2b2-2222-4222-8222-222222222222"
C1, C2 = "c1" * 32, "c2" * 32
SHARED = "5e5e5e5e-0000-4000-8000-000000000001"


def systemd_pod(cgroups, uid, cid, qos="besteffort"):
    """A container's cgroup as the kubelet's systemd driver and containerd make it (a Guaranteed
    pod's slice is directly in kubepods.slice)."""
    pod = f"kubepods-pod{uid.replace('-', '_')}.slice" if qos == "guaranteed" else \
        f"kubepods-{qos}.slice/kubepods-{qos}-pod{uid.replace('-', '_')}.slice"
    return cgroups(f"kubepods.slice/{pod}/cri-containerd-{cid}.scope")


def rows(enf) -> list:
    from convgpu.enforcer.serving.server import request
    return request(enf.control_path, {"cmd": "status"})["status"]["containers"]


def plugin_for(short_tmp, srv, enf, gpus, timeout=10.0) -> DraPlugin:
    from kubernetes.client import ResourceV1Api
    client = srv.client()
    (short_tmp / "dev").mkdir(exist_ok=True)
    for g in gpus:
        (short_tmp / "dev" / f"nvidia{g.index}").touch()
    return DraPlugin(NODE, gpus, lambda ns, name: ResourceV1Api(client).read_namespaced_resource_claim(name, ns),
                     Enforcer(enf.control_path, timeout), CdiDir(str(short_tmp / "cdi")), str(short_tmp / "registry"),
                     str(short_tmp / "plugins"), dev_root=str(short_tmp / "dev"))


def uses(m, pod, container, claims):
    """The pod-resources API's entry: pod's container got devices of these claims."""
    return m.PodResources(namespace=NS, name=pod, containers=[m.ContainerResources(name=container, dynamic_resources=[
        m.DynamicResource(claim_name=c, claim_namespace=NS, claim_resources=[
            m.ClaimResource(driver_name=DRIVER, pool_name=NODE, device_name="gpu-0")]) for c in claims])])


def logs_for(short_tmp, pods):
    """The kubelet's log layout (KubeletLogPods): /var/log/pods/<ns>_<pod>_<uid>, made before the
    pod's containers start, and /var/log/containers/<pod>_<ns>_<container>-<id>.log."""
    root = short_tmp / "log"
    for pod, uid, containers in pods:
        (root / "pods" / f"{NS}_{pod}_{uid}").mkdir(parents=True, exist_ok=True)
        (root / "containers").mkdir(parents=True, exist_ok=True)
        for name, cid in containers:
            (root / "containers" / f"{pod}_{NS}_{name}-{cid}.log").symlink_to("/nonexistent")
    return str(root)


def test_two_pods_on_one_shared_claim_are_held_together_to_it(root, build, cgroups, caller_env, short_tmp):
    """One claim of 2 GiB, reserved for p1 when the kubelet prepared it; p2 shares it (the
    kubelet skips a prepared claim, so only its pod-resources API tells of p2). The enforcer's
    default is 6 GiB: p2 used to run under it and reach 4 GiB beside p1's 2."""
    from convgpu.enforcer.failsafe.stall import make_stopper, v2_has_freeze
    from convgpu.enforcer.tenants.containers import cgroup_layout
    from convgpu.kube.drasync import ClaimSync
    from convgpu.kube.pods import KubeletLogPods
    need(v2_has_freeze(cgroup_layout().v2_root), "no cgroup2 freezer")
    enf = inprocess_enforcer(build / "standin" / "libcuda.so.1", "dra-shared", 6 * GiB, capacity={0: 8 * GiB},
                             stopper=make_stopper("freezer-v2"))
    srv = ApiServer().start()
    srv.put_claim(claim(NS, "shared", SHARED, [("p1", P1)], [("gpu", "gpu-0", "2Gi", None)]))
    m, _ = api.podresources()
    kubelet = DraKubelet(str(short_tmp / "registry"), pod_resources=str(short_tmp / "pr.sock"))
    a = b = None
    try:
        with serving(enf):
            plugin = plugin_for(short_tmp, srv, enf, [dv.Gpu(0, 8 * GiB)])
            plugin.serve()
            kubelet.start()
            assert kubelet.registrations.get(timeout=10)[1] == "v1.DRAPlugin"
            assert kubelet.prepare(DRIVER, [(NS, SHARED, "shared")])[SHARED].error == ""
            # p2 is admitted: the kubelet lists it with the claim; its uid is in its log dir
            kubelet.pods = [uses(m, "p1", "main", ["shared"]), uses(m, "p2", "main", ["shared"])]
            sync = ClaimSync(plugin.enforcer, [KubeletLogPods(logs_for(short_tmp, [("p1", P1, [("main", C1)]),
                                                                                  ("p2", P2, [("main", C2)])]))],
                             str(short_tmp / "pr.sock"))
            sent = sync.round()

            cg1, cg2 = systemd_pod(cgroups, P1, C1), systemd_pod(cgroups, P2, C2, "burstable")
            a = start_in(cg1, build, caller_env, "alloc", "-n", 4, "-s", 256 * MiB, "--hold")
            assert f"allocated 4 {GiB} pid={a.pid}" in read_until(a, "ready")
            b = start_in(cg2, build, caller_env, "alloc", "-n", 8, "-s", 256 * MiB, "--hold")
            # its 5th waits: the claim's 2 GiB are used, 1 GiB by each pod (a frozen task shows "S")
            until(lambda: any(r["gpus"].get("0", {}).get("waiting") for r in rows(enf)), 20, "the claim waits")
            [row] = rows(enf)           # one budget, one row, both consumers
            assert (row["id"], row["name"], row["kind"], row["limit"], row["source"], row["claims"]) == (
                f"claim:{SHARED}", "team/shared", "claim", 2 * GiB, "DRA claim team/shared", [SHARED])
            assert [(c["id"], c["pod"], c["cgroup"].endswith(f"cri-containerd-{c['id']}.scope"), c["pids"])
                    for c in row["consumers"]] == [(C1, P1, True, [a.pid]), (C2, P2, True, [b.pid])]
            assert (row["gpus"]["0"]["used"], row["gpus"]["0"]["limit"]) == (2 * GiB, 2 * GiB)
            # stalled together: the freezer holds both pods' containers
            assert [(cg / "cgroup.freeze").read_text().strip() for cg in (cg1, cg2)] == ["1", "1"]
            # what the agent told: both containers, and p2 as a pod that uses the claim
            assert sent == {SHARED: {"containers": [C1, C2], "users": [P2]}} and enf.rules.claims[SHARED].users == (P2,)
            # p1 ends: its gigabyte is back in the claim, p2's call fits and it runs to its 2 GiB
            a.kill()
            a.wait()
            assert f"allocated 8 {2 * GiB} pid={b.pid}" in read_until(b, "ready")
            [row] = rows(enf)
            assert [c["id"] for c in row["consumers"]] == [C2] and row["gpus"]["0"]["used"] == 2 * GiB
            assert [(cg / "cgroup.freeze").read_text().strip() for cg in (cg1, cg2)] == ["0", "0"]
            plugin.close()
    finally:
        for p in (a, b):
            if p is not None:
                p.kill()
                p.wait()
        kubelet.stop()
        srv.stop()


def test_two_containers_of_one_pod_on_one_claim_are_held_together_to_it(root, build, cgroups, caller_env, short_tmp):
    """One pod, two containers naming one 1 GiB claim: each used to get 1,024 MiB, 2 GiB in all.
    Before and after the agent matched them to it, the two share the claim's gigabyte."""
    from convgpu.kube.drasync import ClaimSync
    from convgpu.kube.pods import KubeletLogPods
    enf = inprocess_enforcer(build / "standin" / "libcuda.so.1", "dra-two", 4 * GiB)
    srv = ApiServer().start()
    srv.put_claim(claim(NS, "one", SHARED, [("p1", P1)], [("gpu", "gpu-0", "1Gi", None)]))
    m, _ = api.podresources()
    kubelet = DraKubelet(str(short_tmp / "registry"), pod_resources=str(short_tmp / "pr.sock"))
    procs = []
    try:
        with serving(enf):
            plugin = plugin_for(short_tmp, srv, enf, [dv.Gpu(0, 4 * GiB)])
            plugin.serve()
            kubelet.start()
            assert kubelet.registrations.get(timeout=10)[1] == "v1.DRAPlugin"
            assert kubelet.prepare(DRIVER, [(NS, SHARED, "one")])[SHARED].error == ""
            procs.append(start_in(systemd_pod(cgroups, P1, C1, "guaranteed"), build, caller_env, "alloc", "-n", 3,
                                  "-s", 256 * MiB, "--hold"))
            assert f"allocated 3 {768 * MiB}" in read_until(procs[0], "ready")[0]
            procs.append(start_in(systemd_pod(cgroups, P1, C2, "guaranteed"), build, caller_env, "alloc", "-n", 2,
                                  "-s", 256 * MiB, "--hold"))
            wait_state(procs[1].pid, "T")        # its second: past the claim's gigabyte
            until(lambda: rows(enf)[0]["gpus"]["0"]["waiting"], 10, "the claim waits")
            [row] = rows(enf)
            assert (row["limit"], row["source"], row["gpus"]["0"]["used"], [c["id"] for c in row["consumers"]]) == (
                GiB, "DRA claim team/one", GiB, [C1, C2])
            # matched by the agent: the same budget
            kubelet.pods = [m.PodResources(namespace=NS, name="p1", containers=[
                m.ContainerResources(name=n, dynamic_resources=uses(m, "p1", n, ["one"]).containers[0].dynamic_resources)
                for n in ("a", "b")])]
            sync = ClaimSync(plugin.enforcer, [KubeletLogPods(logs_for(short_tmp, [("p1", P1, [("a", C1), ("b", C2)])]))],
                             str(short_tmp / "pr.sock"))
            assert sync.round() == {SHARED: {"containers": [C1, C2], "users": []}}
            [row] = rows(enf)
            assert (row["limit"], row["gpus"]["0"]["used"], row["gpus"]["0"]["waiting"]) == (GiB, GiB, True)
            procs[0].kill()                       # the first container's memory back: the second runs
            procs[0].wait()
            assert f"allocated 2 {512 * MiB} pid={procs[1].pid}" in read_until(procs[1], "ready")
            plugin.close()
    finally:
        for p in procs:
            p.kill()
            p.wait()
        kubelet.stop()
        srv.stop()


def test_a_container_gets_nothing_on_a_gpu_its_claim_does_not_name(root, build, cgroups, caller_env, short_tmp):
    """A two-GPU node, a 1 GiB claim on GPU 0. A container that can see GPU 1 too used to get the
    claim's gigabyte there as well; the scheduler counted the claim on GPU 0 only."""
    enf = inprocess_enforcer(build / "standin" / "libcuda.so.1", "dra-gpu1", 4 * GiB, capacity={0: 4 * GiB, 1: 4 * GiB})
    srv = ApiServer().start()
    srv.put_claim(claim(NS, "zero", SHARED, [("p1", P1)], [("gpu", "gpu-0", "1Gi", None)]))
    kubelet = DraKubelet(str(short_tmp / "registry"))
    procs = []
    env = dict(caller_env, CONVGPU_STANDIN_DEVICES="2")
    try:
        with serving(enf):
            plugin = plugin_for(short_tmp, srv, enf, [dv.Gpu(0, 4 * GiB), dv.Gpu(1, 4 * GiB)])
            plugin.serve()
            kubelet.start()
            assert kubelet.registrations.get(timeout=10)[1] == "v1.DRAPlugin"
            assert kubelet.prepare(DRIVER, [(NS, SHARED, "zero")])[SHARED].error == ""
            procs.append(start_in(systemd_pod(cgroups, P1, C1), build, env, "alloc", "-n", 1, "-s", 256 * MiB,
                                  "-d", 1, "--hold"))
            wait_state(procs[0].pid, "T")
            until(lambda: rows(enf) and rows(enf)[0]["gpus"].get("1", {}).get("over_limit"), 10, "over on GPU 1")
            [row] = rows(enf)
            assert (row["source"], row["gpus"]["1"]["limit"], row["gpus"]["1"]["used"]) == ("DRA claim team/zero", 0, 0)
            assert all(g["limit"] == GiB for d, g in row["gpus"].items() if d == "0")
            plugin.close()
    finally:
        for p in procs:
            p.kill()
            p.wait()
        kubelet.stop()
        srv.stop()


def test_an_admin_access_claim_is_prepared_on_a_full_gpu_and_charges_nothing(root, build, short_tmp):
    """The GPU's 4 GiB are all claimed; a monitoring pod's adminAccess claim is prepared beside
    them (the scheduler allocated it without counting it): no share is sent, none is kept, and
    its CDI spec gives the GPU without the shim or a limit."""
    enf = inprocess_enforcer(build / "standin" / "libcuda.so.1", "dra-admin", 4 * GiB)
    srv = ApiServer().start()
    full, mon = ("ml", SHARED, "full"), ("ml", "ad0ad0ad-0000-4000-8000-000000000002", "monitor")
    srv.put_claim(claim("ml", "full", SHARED, [("p1", P1)], [("gpu", "gpu-0", "4Gi", None)]))
    srv.put_claim(claim("ml", "monitor", mon[1], [("dcgm", P2)], [("gpu", "gpu-0", None, None)], admin=True))
    kubelet = DraKubelet(str(short_tmp / "registry"))
    try:
        with serving(enf):
            plugin = plugin_for(short_tmp, srv, enf, [dv.Gpu(0, 4 * GiB)])
            plugin.serve()
            kubelet.start()
            assert kubelet.registrations.get(timeout=10)[1] == "v1.DRAPlugin"
            got = kubelet.prepare(DRIVER, [full, mon])
            assert {u: r.error for u, r in got.items()} == {SHARED: "", mon[1]: ""}
            assert [d.device_name for d in got[mon[1]].devices] == ["gpu-0"]
            assert sorted(enf.rules.claims) == [SHARED] and enf.rules.claims[SHARED].bytes == 4 * GiB
            writes = enf.durable.writes
            assert kubelet.prepare(DRIVER, [mon])[mon[1]].error == "" and enf.durable.writes == writes
            spec = json.loads((short_tmp / "cdi" / f"convgpu-claim-{mon[1]}.json").read_text())
            assert spec["containerEdits"] == {"env": ["CONVGPU_DRA_CLAIM=ml/monitor"]}
            assert spec["devices"][0]["containerEdits"]["env"] == ["NVIDIA_VISIBLE_DEVICES=void"]
            assert kubelet.unprepare(DRIVER, [mon])[mon[1]].error == "" and sorted(enf.rules.claims) == [SHARED]
            plugin.close()
    finally:
        kubelet.stop()
        srv.stop()
