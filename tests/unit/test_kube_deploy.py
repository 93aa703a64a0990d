"""The Kubernetes deployment (deploy/kubernetes) as `kubectl kustomize` renders it: the objects,
what the DaemonSet mounts and may do, and that its commands use options the CLI has."""
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import typer
import yaml

from conftest import need
from convgpu.cli.main import app

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"


def render(path) -> list[dict]:
    kubectl = shutil.which("kubectl")
    need(kubectl is not None, "kubectl not installed (scripts/setup.sh installs kubernetes-client)")
    r = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


@pytest.fixture(scope="module")
def objects():
    return {(d["kind"], d["metadata"]["name"]): d for d in render(DEPLOY / "base")}


def test_the_base_renders_these_objects_in_the_convgpu_namespace(objects):
    assert sorted(objects) == [("ClusterRole", "convgpu-pod-reader"), ("ClusterRoleBinding", "convgpu-pod-reader"),
                               ("ConfigMap", "convgpu-options"), ("DaemonSet", "convgpu"), ("Namespace", "convgpu"),
                               ("Service", "convgpu-metrics"), ("ServiceAccount", "convgpu")]
    for (kind, _), d in objects.items():
        if kind not in ("Namespace", "ClusterRole", "ClusterRoleBinding"):
            assert d["metadata"]["namespace"] == "convgpu", kind
    assert objects[("Namespace", "convgpu")]["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"


def test_rbac_reads_pods_only(objects):
    assert objects[("ClusterRole", "convgpu-pod-reader")]["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    b = objects[("ClusterRoleBinding", "convgpu-pod-reader")]
    assert b["subjects"] == [{"kind": "ServiceAccount", "name": "convgpu", "namespace": "convgpu"}]
    assert b["roleRef"]["name"] == "convgpu-pod-reader"


def test_daemonset_is_privileged_on_gpu_nodes_with_the_host_paths(objects):
    ds = objects[("DaemonSet", "convgpu")]
    spec = ds["spec"]["template"]["spec"]
    assert spec["hostPID"] is True and spec["serviceAccountName"] == "convgpu"
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert ds["spec"]["selector"]["matchLabels"] == ds["spec"]["template"]["metadata"]["labels"]
    hosts = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"]}
    assert hosts == {"bpffs": "/sys/fs/bpf", "tracefs": "/sys/kernel/tracing", "debugfs": "/sys/kernel/debug",
                     "cgroup": "/sys/fs/cgroup", "modules": "/lib/modules", "headers": "/usr/src",
                     "run": "/run/convgpu", "device-plugins": "/var/lib/kubelet/device-plugins",
                     "pod-resources": "/var/lib/kubelet/pod-resources", "logs": "/var/log"}
    c = {x["name"]: x for x in spec["containers"]}
    assert sorted(c) == ["enforce", "kube"]
    mounts = {n: {m["name"]: (m["mountPath"], m.get("readOnly", False)) for m in x["volumeMounts"]} for n, x in c.items()}
    assert mounts["enforce"] == {"bpffs": ("/sys/fs/bpf", False), "tracefs": ("/sys/kernel/tracing", False),
                                 "debugfs": ("/sys/kernel/debug", False), "cgroup": ("/sys/fs/cgroup", False),
                                 "modules": ("/lib/modules", True), "headers": ("/usr/src", True),
                                 "run": ("/run/convgpu", False)}
    assert mounts["kube"] == {"device-plugins": ("/var/lib/kubelet/device-plugins", False),
                              "pod-resources": ("/var/lib/kubelet/pod-resources", False),
                              "logs": ("/var/log", True), "run": ("/run/convgpu", False)}
    for x in c.values():
        assert x["securityContext"] == {"privileged": True}
        assert x["image"] == "convgpu:0.1.0"
        assert x["envFrom"] == [{"configMapRef": {"name": "convgpu-options"}}]
    nvml = [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}, {"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "utility"}]
    assert c["enforce"]["env"] == nvml
    assert c["kube"]["env"] == nvml + [{"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]
    assert c["enforce"]["ports"] == [{"name": "metrics", "containerPort": 9400}]


def _options(command: str) -> set[str]:
    cmd = typer.main.get_command(app).commands[command]
    return {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)}


def test_commands_use_the_clis_options_and_every_value_is_used(objects):
    spec = objects[("DaemonSet", "convgpu")]["spec"]["template"]["spec"]
    values = set(objects[("ConfigMap", "convgpu-options")]["data"])
    assert values == {"POLICY", "UNIT", "DEFAULT_LIMIT", "STALL", "OVER_LIMIT", "GPU_MEMORY", "RESERVE", "METRICS_PORT"}
    used = set()
    for c in spec["containers"]:
        assert c["command"] == ["/bin/sh", "-c"]
        words = shlex.split(c["args"][0])
        assert words[:3] == ["exec", "convgpu", c["name"]]
        flags = {w for w in words if w.startswith("--")}
        assert flags <= _options(c["name"]), flags - _options(c["name"])
        used |= set(re.findall(r"\$\{?([A-Z_]+)", c["args"][0]))
    assert used == values


def test_metrics_service_and_service_monitor():
    objs = {(d["kind"], d["metadata"]["name"]): d for d in render(DEPLOY / "monitoring")}
    svc = objs[("Service", "convgpu-metrics")]["spec"]
    assert svc["clusterIP"] == "None" and svc["selector"] == {"app.kubernetes.io/name": "convgpu"}
    assert svc["ports"] == [{"name": "metrics", "port": 9400, "targetPort": "metrics"}]
    sm = objs[("ServiceMonitor", "convgpu")]
    assert sm["apiVersion"] == "monitoring.coreos.com/v1" and sm["metadata"]["namespace"] == "convgpu"
    assert sm["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": "convgpu"}
    assert sm["spec"]["endpoints"] == [{"port": "metrics", "interval": "30s"}]
    assert len(objs) == 8


def test_an_overlay_sets_the_enforcers_options_and_image(tmp_path):
    (tmp_path / "kustomization.yaml").write_text(f"""bases:
- {os.path.relpath(DEPLOY / "base", tmp_path)}
images:
- name: convgpu
  newName: registry.example/convgpu
  newTag: "0.2"
configMapGenerator:
- name: convgpu-options
  behavior: merge
  literals: [POLICY=bfa, GPU_MEMORY=20GiB]
""")
    objs = {(d["kind"], d["metadata"]["name"]): d for d in render(tmp_path)}
    data = objs[("ConfigMap", "convgpu-options")]["data"]
    assert (data["POLICY"], data["GPU_MEMORY"], data["UNIT"]) == ("bfa", "20GiB", "256MiB")
    spec = objs[("DaemonSet", "convgpu")]["spec"]["template"]["spec"]
    assert {c["image"] for c in spec["containers"]} == {"registry.example/convgpu:0.2"}


def test_the_image_recipe_installs_bcc_and_the_agent():
    text = (DEPLOY.parent / "Containerfile").read_text()
    assert "FROM ubuntu:24.04" in text and "python3-bpfcc" in text and "--system-site-packages" in text
    assert "pip install --no-cache-dir '/src[k8s]'" in text
