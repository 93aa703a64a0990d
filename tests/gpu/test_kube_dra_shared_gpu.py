"""Issue 48 on the real driver (an H100 or H200): two pods sharing one 20 GiB DRA claim together
hold at most 20 GiB by NVML. `convgpu enforce` (its default limit 6 GiB: a pod the claim did not
bind would run under it) and `convgpu kube --dra` as the DaemonSet runs them, the test-side
kubelet (plugin registration, DRAPlugin v1, and the pod-resources API that tells the agent of
the second pod: the kubelet prepares a claim once, for the pod reserved then), the API-server
double. Each pod's container is a cgroup laid out as the kubelet's systemd driver lays it out,
running PyTorch with the environment the claim's CDI spec gives: p1 takes 12 GiB, then p2 asks
1 GiB after 1 GiB, 28 in all, and is held (or told out-of-memory by the shim) once the two hold
the claim's 20 GiB, contexts included. The counts go to $CONVGPU_DRA_OUT (else $OUT, else the
folder of $CONVGPU_GPU_LOG) as kube-dra-shared.json. About a minute."""
import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest

from conftest import lines_until, need, popen_in, proc_state
from test_kube_dra_gpu import WORK, _cdi_env, _out_dir, stop_and_record

pytestmark = pytest.mark.gpu
GiB = 1 << 30
DRIVER, NODE, NS, CLAIM = "gpu-memory.convgpu.io", "gpu-node", "ml", "5e5e5e5e-0000-4000-8000-000000000048"
PODS = {"p1": ("a1a1a1a1-1111-4111-8111-111111111111", "c1" * 32, 12),      # name: pod uid, container id, GiB asked
        "p2": ("b2b2b2b2-2222-4222-8222-222222222222", "c2" * 32, 28)}


def _systemd_pod(cgroups, uid, cid):
    return cgroups(f"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid.replace('-', '_')}.slice/"
                   f"cri-containerd-{cid}.scope")


def _until(cond, timeout, what):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, what
        time.sleep(0.2)


def test_two_pods_sharing_one_claim_hold_at_most_the_claim(root, cgroups, short_tmp):
    need(all(importlib.util.find_spec(m) for m in ("torch", "grpc", "kubernetes")),
         "needs torch, grpcio(-tools) and kubernetes (tests/gpu/env.sh: the k8s wheels in .wheels-k8s)")
    import pynvml

    from apiserver_double import ApiServer, claim
    from convgpu.enforcer.serving.server import request
    from convgpu.kube import api
    from kubelet_side import DraKubelet
    run, state, logs = short_tmp / "run", short_tmp / "state", short_tmp / "log"
    srv = ApiServer().start()
    kubelet = DraKubelet(str(short_tmp / "registry"), pod_resources=str(short_tmp / "pr.sock"))
    m, _ = api.podresources()
    env = dict(os.environ, KUBECONFIG=srv.kubeconfig(short_tmp / "kubeconfig"))
    enf = subprocess.Popen([sys.executable, "-m", "convgpu.cli.main", "enforce", "--run-dir", str(run),
                            "--state-dir", str(state), "--default-limit", "6GiB", "--policy", "fifo"],
                           stderr=subprocess.PIPE, text=True, cwd="/")
    log, agent, procs, result = [], None, {}, {"claim_gib": 20, "pods": {}}
    agent_log = open(short_tmp / "agent.log", "w")
    try:
        lines_until(enf.stderr, lambda line: "enforcing:" in line, log, 90, "enforcer")
        agent = subprocess.Popen([sys.executable, "-m", "convgpu.cli.main", "kube", "--dra", "--node-name", NODE,
                                  "--api", "off", "--registry-dir", str(short_tmp / "registry"),
                                  "--plugins-dir", str(short_tmp / "plugins"), "--cdi-dir", str(short_tmp / "cdi"),
                                  "--run-dir", str(run), "--pod-resources", str(short_tmp / "pr.sock"),
                                  "--log-root", str(logs), "--sync", "0.5"], stderr=agent_log, text=True, env=env, cwd="/")
        kubelet.start()
        assert kubelet.registrations.get(timeout=60)[1] == "v1.DRAPlugin"
        device = srv.slices[f"{NODE}-{DRIVER}"]["spec"]["devices"][0]
        uuid = device["attributes"]["uuid"]["string"]
        srv.put_claim(claim(NS, "shared", CLAIM, [("p1", PODS["p1"][0])], [("gpu", device["name"], "20Gi", None)],
                            pool=NODE))
        assert kubelet.prepare(DRIVER, [(NS, CLAIM, "shared")])[CLAIM].error == ""
        # both pods admitted by the kubelet, their logs laid out: the agent tells the enforcer of p2
        for name, (uid, cid, _) in PODS.items():
            (logs / "pods" / f"{NS}_{name}_{uid}").mkdir(parents=True)
            (logs / "containers").mkdir(exist_ok=True)
            (logs / "containers" / f"{name}_{NS}_main-{cid}.log").symlink_to("/nonexistent")
        kubelet.pods = [m.PodResources(namespace=NS, name=name, containers=[m.ContainerResources(name="main", dynamic_resources=[
            m.DynamicResource(claim_name="shared", claim_namespace=NS, claim_resources=[
                m.ClaimResource(driver_name=DRIVER, pool_name=NODE, device_name=device["name"])])])]) for name in PODS]
        control = str(run / "control.sock")
        _until(lambda: request(control, {"cmd": "claim-list"})["claims"].get(CLAIM, {}).get("users") == [PODS["p2"][0]],
               30, "the enforcer told of p2")
        spec = json.loads((short_tmp / "cdi" / f"convgpu-claim-{CLAIM}.json").read_text())
        penv = dict(os.environ, **_cdi_env(spec), CUDA_VISIBLE_DEVICES=uuid)
        for name, (uid, cid, gib) in PODS.items():   # p1 first, to its 12 GiB; then p2
            procs[name] = popen_in(_systemd_pod(cgroups, uid, cid), sys.executable, "-c", WORK, str(gib), env=penv)
            lines = []
            first = json.loads(lines_until(procs[name].stdout, lambda line: line.startswith('{"pid"'), lines, 120, name))
            end = None
            while end is None:
                try:
                    line = lines_until(procs[name].stdout, lambda line: True, lines, 15, name)
                except AssertionError:
                    end = f"held (state {proc_state(procs[name].pid)})"
                    break
                end = next((k for k in ("oom", "all") if k in json.loads(line)), None)
            got = max((json.loads(x).get("got", 0) for x in lines if x.startswith('{"got"')), default=0)
            result["pods"][name] = {"pid": first["pid"], "mem_get_info": first, "asked_gib": gib, "got_gib": got, "end": end}
        time.sleep(2)    # NVML's per-process figures settle
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        used = {x.pid: x.usedGpuMemory for x in pynvml.nvmlDeviceGetComputeRunningProcesses(h)}
        for r in result["pods"].values():
            r["nvml_used"] = used.get(r["pid"])
        result["nvml_sum"] = sum(r["nvml_used"] or 0 for r in result["pods"].values())
        status = request(control, {"cmd": "status"})["status"]
        result["rows"] = [{k: c[k] for k in ("id", "name", "kind", "limit", "source", "consumers", "gpus")}
                          for c in status["containers"]]
        if _out_dir():
            with open(os.path.join(_out_dir(), "kube-dra-shared.json"), "w") as f:
                json.dump(result, f, indent=1)
        p1, p2 = result["pods"]["p1"], result["pods"]["p2"]
        assert p1["end"] == "all" and p1["got_gib"] == 12, p1
        assert p2["end"] == "oom" or p2["end"].startswith("held (state T"), p2
        assert all(r["nvml_used"] is not None for r in (p1, p2)), result
        assert 17 * GiB <= result["nvml_sum"] <= 20 * GiB, result          # together: at most the claim
        [row] = [r for r in result["rows"] if r["kind"] == "claim"]
        assert (row["limit"], row["source"], [c["id"] for c in row["consumers"]]) == (
            20 * GiB, "DRA claim ml/shared", [PODS["p1"][1], PODS["p2"][1]])
    finally:
        stop_and_record("kube dra shared claim", procs, (agent, enf), kubelet, srv, agent_log, short_tmp, result, log)
