"""Issue 40 on the real driver (an H100 or H200): `convgpu enforce` and `convgpu kube --dra` as
the DaemonSet runs them, the test-side kubelet (plugin registration, DRAPlugin v1) and the
API-server double (the plugin reads its claims and publishes its ResourceSlice there, over HTTP).
Two claims of 20 GiB and 40 GiB on one card, as the scheduler would allocate them from the
published slice; each is prepared, and a PyTorch process runs in a cgroup of each pod laid out
as the kubelet lays them out, with the environment its claim's CDI spec gives (the preload shim:
a runtime applies the spec's env and bind mounts; here the mounts' host paths stand in for the
container paths). Each asks for 1 GiB after 1 GiB, more than its share, and is held at its
claim: the shim's answer is out-of-memory (or, if the probes stop it first, it waits), and
NVML's count of each process stays within its claim. The counts go to $CONVGPU_DRA_OUT (else
$OUT, else the folder of $CONVGPU_GPU_LOG) as kube-dra.json, for docs/gpu-runs/. About a minute."""
import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest

from conftest import lines_until, need, popen_in, proc_state

pytestmark = pytest.mark.gpu
GiB = 1 << 30
DRIVER, NODE = "gpu-memory.convgpu.io", "gpu-node"
PODS = {"small": ("d1a00000-0000-4000-8000-000000000001", "c1a00000-0000-4000-8000-000000000001", "a6" * 32, 20),
        "large": ("d1b00000-0000-4000-8000-000000000002", "c1b00000-0000-4000-8000-000000000002", "b7" * 32, 40)}
WORK = r"""
import json, os, sys, torch
free, total = torch.cuda.mem_get_info()
print(json.dumps({"pid": os.getpid(), "free": free, "total": total}), flush=True)
chunks = []
try:
    while len(chunks) < int(sys.argv[1]):
        chunks.append(torch.empty(1 << 30, dtype=torch.uint8, device="cuda"))
        chunks[-1][::1 << 20].fill_(1)
        print(json.dumps({"got": len(chunks)}), flush=True)
    print(json.dumps({"all": len(chunks)}), flush=True)
except torch.cuda.OutOfMemoryError:
    print(json.dumps({"oom": len(chunks)}), flush=True)
sys.stdin.readline()
"""


def _out_dir() -> str | None:
    for d in (os.environ.get("CONVGPU_DRA_OUT"), os.environ.get("OUT"),
              os.path.dirname(os.environ.get("CONVGPU_GPU_LOG", "")) or None):
        if d:
            os.makedirs(d, exist_ok=True)
            return d
    return None


def _cdi_env(spec: dict) -> dict:
    """The spec's environment as the container would see it, each container path of its bind
    mounts replaced by the host path (no runtime here to mount them)."""
    env = dict(e.split("=", 1) for e in spec["containerEdits"]["env"])
    for m in spec["containerEdits"]["mounts"]:
        env = {k: v.replace(m["containerPath"], m["hostPath"]) for k, v in env.items()}
    return env


def stop_and_record(scenario, procs, daemons, kubelet, srv, agent_log, short_tmp, result, log):
    """A DRA test's finally: its pods' processes killed, the agent and the enforcer stopped, the
    kubelet double and the driver's server stopped, and what it saw in the run's log."""
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.wait()
    for p in daemons:
        if p is not None and p.poll() is None:
            p.terminate()
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
    kubelet.stop()
    srv.stop()
    agent_log.close()
    result["agent_log"] = (short_tmp / "agent.log").read_text().splitlines()[-40:]
    if os.environ.get("CONVGPU_GPU_LOG"):
        with open(os.environ["CONVGPU_GPU_LOG"], "a") as f:
            f.write(json.dumps({"scenario": scenario, **result, "log": log[-40:]}) + "\n")


def test_two_claims_on_one_card_each_held_at_its_claim(root, cgroups, short_tmp):
    need(all(importlib.util.find_spec(m) for m in ("torch", "grpc", "kubernetes")),
         "needs torch, grpcio(-tools) and kubernetes (tests/gpu/env.sh: the k8s wheels in .wheels)")
    import pynvml

    from apiserver_double import ApiServer, claim
    from kubelet_side import DraKubelet
    run, state = short_tmp / "run", short_tmp / "state"
    srv = ApiServer().start()
    kubelet = DraKubelet(str(short_tmp / "registry"))
    env = dict(os.environ, KUBECONFIG=srv.kubeconfig(short_tmp / "kubeconfig"))
    enf = subprocess.Popen([sys.executable, "-m", "convgpu.cli.main", "enforce", "--run-dir", str(run),
                            "--state-dir", str(state), "--default-limit", "1GiB", "--policy", "fifo"],
                           stderr=subprocess.PIPE, text=True, cwd="/")
    log, agent, procs, result = [], None, {}, {"claims": {}}
    agent_log = open(short_tmp / "agent.log", "w")    # a file: a pipe nobody reads would fill
    try:
        lines_until(enf.stderr, lambda line: "enforcing:" in line, log, 90, "enforcer")
        agent = subprocess.Popen([sys.executable, "-m", "convgpu.cli.main", "kube", "--dra", "--node-name", NODE,
                                  "--api", "off", "--registry-dir", str(short_tmp / "registry"),
                                  "--plugins-dir", str(short_tmp / "plugins"), "--cdi-dir", str(short_tmp / "cdi"),
                                  "--run-dir", str(run), "--pod-resources", str(short_tmp / "none.sock"),
                                  "--log-root", str(short_tmp / "log")], stderr=agent_log, text=True, env=env, cwd="/")
        kubelet.start()
        assert kubelet.registrations.get(timeout=60)[1] == "v1.DRAPlugin"
        device = srv.slices[f"{NODE}-{DRIVER}"]["spec"]["devices"][0]   # GPU 0 as published
        result["slice_device"] = device
        for name, (pod, uid, _, size) in PODS.items():
            srv.put_claim(claim("ml", name, uid, [(name, pod)], [("gpu", device["name"], f"{size}Gi", None)], pool=NODE))
        got = kubelet.prepare(DRIVER, [("ml", uid, name) for name, (_, uid, _, _) in PODS.items()])
        assert {u: r.error for u, r in got.items()} == {uid: "" for _, uid, _, _ in PODS.values()}
        for name, (pod, uid, cid, size) in PODS.items():
            spec = json.loads((short_tmp / "cdi" / f"convgpu-claim-{uid}.json").read_text())
            penv = dict(os.environ, **_cdi_env(spec), CUDA_VISIBLE_DEVICES=device["attributes"]["uuid"]["string"])
            procs[name] = popen_in(cgroups(f"kubepods/besteffort/pod{pod}/{cid}"), sys.executable, "-c", WORK,
                                   str(size + 8), env=penv)
        for name, p in procs.items():
            lines = []
            first = json.loads(lines_until(p.stdout, lambda line: line.startswith('{"pid"'), lines, 120, name))
            end = None
            while end is None:   # each 1 GiB is a line: until out-of-memory, or 15 s without one (held)
                try:
                    line = lines_until(p.stdout, lambda line: True, lines, 15, name)
                except AssertionError:
                    end = f"held (state {proc_state(p.pid)})"
                    break
                end = next((k for k in ("oom", "all") if k in json.loads(line)), None)
            gib = max((json.loads(x).get("got", 0) for x in lines if x.startswith('{"got"')), default=0)
            result["claims"][name] = {"claim_gib": PODS[name][3], "pid": first["pid"], "mem_get_info": first,
                                      "got_gib": gib, "end": end}
        time.sleep(2)    # NVML's per-process figures settle
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByUUID(device["attributes"]["uuid"]["string"])
        used = {x.pid: x.usedGpuMemory for x in pynvml.nvmlDeviceGetComputeRunningProcesses(h)}
        result["nvml_total"] = pynvml.nvmlDeviceGetMemoryInfo(h).total
        status = json.loads(subprocess.run([sys.executable, "-m", "convgpu.cli.main", "status", "--json", "--run-dir",
                                            str(run)], capture_output=True, text=True, timeout=60).stdout)
        rows = {c["id"]: c for c in status["containers"]}
        for name, (_, _, cid, size) in PODS.items():
            r = result["claims"][name]
            r["nvml_used"] = used.get(r["pid"])
            r["enforcer"] = {k: rows[cid][k] for k in ("limit", "source")} | {"gpus": rows[cid]["gpus"]}
        if _out_dir():
            with open(os.path.join(_out_dir(), "kube-dra.json"), "w") as f:
                json.dump(result, f, indent=1)
        for name, (_, _, cid, size) in PODS.items():
            r = result["claims"][name]
            assert r["enforcer"]["limit"] == size * GiB and r["enforcer"]["source"] == f"DRA claim ml/{name}"
            assert size * GiB - 2 * GiB <= r["mem_get_info"]["total"] <= size * GiB      # the claim less its context
            assert r["end"] == "oom" or r["end"].startswith("held (state T")
            assert r["nvml_used"] is not None and size * GiB - 3 * GiB <= r["nvml_used"] <= size * GiB, r
    finally:
        stop_and_record("kube dra two claims", procs, (agent, enf), kubelet, srv, agent_log, short_tmp, result, log)
