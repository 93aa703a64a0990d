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
                               ("ServiceAccount", "convgpu")]
    for (kind, _), d in objects.items():
        if kind not in ("Namespace", "ClusterRole", "ClusterRoleBinding"):
            assert d["metadata"]["namespace"] == "convgpu", kind
    assert objects[("Namespace", "convgpu")]["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"


def schema_check(docs):
    """Each object read into the Kubernetes client's models (generated from the API's OpenAPI
    schema) and written back must come out the same: a misspelt or misplaced field is dropped
    on the way and shows as a difference. Custom resources (ServiceMonitor) are left out."""
    import json
    from kubernetes.client import ApiClient
    api = ApiClient()
    for d in docs:
        if "." in d["apiVersion"].split("/")[0] and not d["apiVersion"].startswith(("rbac.", "networking.")):
            continue
        back = api.sanitize_for_serialization(api.deserialize(json.dumps(d), "V1" + d["kind"], "application/json"))
        assert back == d, (d["kind"], d["metadata"]["name"])


def test_every_rendering_passes_the_schema_check_and_a_typo_would_not(tmp_path):
    for path in (DEPLOY / "base", DEPLOY / "monitoring"):
        schema_check(render(path))
    docs = render(DEPLOY / "base")
    ds = next(d for d in docs if d["kind"] == "DaemonSet")
    ds["spec"]["template"]["spec"]["containers"][1]["readinesProbe"] = {"exec": {"command": ["true"]}}
    with pytest.raises(AssertionError):
        schema_check([ds])


def test_rbac_reads_pods_only(objects):
    assert objects[("ClusterRole", "convgpu-pod-reader")]["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    b = objects[("ClusterRoleBinding", "convgpu-pod-reader")]
    assert b["subjects"] == [{"kind": "ServiceAccount", "name": "convgpu", "namespace": "convgpu"}]
    assert b["roleRef"]["name"] == "convgpu-pod-reader"


def _spec(objs):
    return objs[("DaemonSet", "convgpu")]["spec"]["template"]["spec"]


def test_daemonset_only_the_enforcer_privileged_only_the_host_paths_it_needs(objects):
    ds = objects[("DaemonSet", "convgpu")]
    spec = _spec(objects)
    assert spec["hostPID"] is True and spec["serviceAccountName"] == "convgpu"
    assert ds["spec"]["selector"]["matchLabels"] == ds["spec"]["template"]["metadata"]["labels"]
    hosts = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    assert hosts == {"bpffs": "/sys/fs/bpf", "tracefs": "/sys/kernel/tracing", "debugfs": "/sys/kernel/debug",
                     "cgroup": "/sys/fs/cgroup", "modules": "/lib/modules", "headers": "/usr/src",
                     "run": "/run/convgpu", "bpf-cache": "/var/cache/convgpu", "state": "/var/lib/convgpu",
                     "device-plugins": "/var/lib/kubelet/device-plugins",
                     "pod-resources": "/var/lib/kubelet/pod-resources",
                     "pod-logs": "/var/log/pods", "container-logs": "/var/log/containers"}   # not all of /var/log
    c = {x["name"]: x for x in spec["containers"]}
    assert sorted(c) == ["enforce", "kube"]
    mounts = {n: {m["name"]: (m["mountPath"], m.get("readOnly", False)) for m in x["volumeMounts"]} for n, x in c.items()}
    assert mounts["enforce"] == {"bpffs": ("/sys/fs/bpf", False), "tracefs": ("/sys/kernel/tracing", False),
                                 "debugfs": ("/sys/kernel/debug", False), "cgroup": ("/sys/fs/cgroup", False),
                                 "modules": ("/lib/modules", True), "headers": ("/usr/src", True),
                                 "run": ("/run/convgpu", False), "bpf-cache": ("/var/cache/convgpu", False),
                                 "state": ("/var/lib/convgpu", False),   # decisions survive a restart
                                 "device-plugins": ("/var/lib/kubelet/device-plugins", True),
                                 "pod-resources": ("/var/lib/kubelet/pod-resources", True)}
    assert mounts["kube"] == {"device-plugins": ("/var/lib/kubelet/device-plugins", False),
                              "pod-resources": ("/var/lib/kubelet/pod-resources", False),
                              "pod-logs": ("/var/log/pods", True), "container-logs": ("/var/log/containers", True),
                              "run": ("/run/convgpu", False), "tmp": ("/tmp", False)}
    assert c["enforce"]["securityContext"] == {"privileged": True}
    assert c["kube"]["securityContext"] == {"runAsUser": 0, "allowPrivilegeEscalation": False,
                                            "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}
    for x in c.values():
        assert x["image"] == "convgpu:0.1.0"
        assert x["envFrom"] == [{"configMapRef": {"name": "convgpu-options"}}]
        assert set(x["resources"]["requests"]) == {"cpu", "memory"} and set(x["resources"]["limits"]) == {"memory"}
    env = {n: {e["name"]: e.get("value") for e in x["env"]} for n, x in c.items()}
    assert env["enforce"]["CONVGPU_BPF_CACHE"] == "/var/cache/convgpu/bpf"     # on the host: a restart replays
    assert env["kube"]["NODE_NAME"] is None and env["kube"]["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert c["enforce"]["ports"] == [{"name": "metrics", "containerPort": 9400}]


def test_probes_run_the_probe_module_and_doctor_sees_the_kubelet_from_the_enforcer(objects):
    from convgpu.kube import doctor, pods
    c = {x["name"]: x for x in _spec(objects)["containers"]}
    probe = ["python3", "-m", "convgpu.kube.probe"]
    for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c["enforce"][kind]["exec"]["command"] == probe + ["enforcer"]
    for kind in ("livenessProbe", "readinessProbe"):
        assert c["kube"][kind]["exec"]["command"] == probe + ["plugin"]
    seen = {m["mountPath"] for m in c["enforce"]["volumeMounts"]}
    assert doctor.PLUGIN_DIR in seen and os.path.dirname(pods.POD_RESOURCES) in seen


def test_nodes_by_any_gpu_label_and_every_noschedule_taint(objects):
    spec = _spec(objects)
    assert "nodeSelector" not in spec
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert [t["matchExpressions"][0]["key"] for t in terms] == [
        "nvidia.com/gpu.present", "feature.node.kubernetes.io/pci-10de.present", "convgpu.io/gpu"]
    assert {"operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]


@pytest.mark.parametrize("name,root", [("microk8s", "/var/snap/microk8s/common/var/lib/kubelet"),
                                       ("k0s", "/var/lib/k0s/kubelet")])
def test_a_component_moves_the_kubelet_root(tmp_path, name, root):
    (tmp_path / "kustomization.yaml").write_text(f"""resources:
- {os.path.relpath(DEPLOY / "base", tmp_path)}
components:
- {os.path.relpath(DEPLOY / "components" / f"kubelet-{name}", tmp_path)}
""")
    docs = render(tmp_path)
    schema_check(docs)
    spec = _spec({(d["kind"], d["metadata"]["name"]): d for d in docs})
    hosts = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    assert (hosts["device-plugins"], hosts["pod-resources"]) == (f"{root}/device-plugins", f"{root}/pod-resources")
    assert hosts["run"] == "/run/convgpu"


def _options(command: str) -> set[str]:
    cmd = typer.main.get_command(app).commands[command]
    return {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)}


def test_commands_use_the_clis_options_and_every_value_is_used(objects):
    spec = objects[("DaemonSet", "convgpu")]["spec"]["template"]["spec"]
    values = set(objects[("ConfigMap", "convgpu-options")]["data"])
    assert values == {"POLICY", "UNIT", "DEFAULT_LIMIT", "STALL", "OVER_LIMIT", "GPU_MEMORY", "RESERVE", "METRICS_PORT",
                      "METRICS_ADDRESS", "METRICS_TLS"}
    used = set()
    for c in spec["containers"]:
        assert c["command"] == ["/bin/sh", "-c"]
        words = shlex.split(c["args"][0])
        assert words[:3] == ["exec", "convgpu", c["name"]]
        flags = {w for w in words if w.startswith("--")}
        assert flags <= _options(c["name"]), flags - _options(c["name"])
        used |= set(re.findall(r"\$\{?([A-Z_]+)", c["args"][0]))
    assert used == values


def test_metrics_on_loopback_in_the_base_mutual_tls_to_prometheus_alone_in_monitoring(objects):
    """Row 11 of docs/SECURITY.md, as deployed."""
    assert objects[("ConfigMap", "convgpu-options")]["data"]["METRICS_ADDRESS"] == "127.0.0.1"
    assert objects[("ConfigMap", "convgpu-options")]["data"]["METRICS_TLS"] == ""
    objs = {(d["kind"], d["metadata"]["name"]): d for d in render(DEPLOY / "monitoring")}
    data = objs[("ConfigMap", "convgpu-options")]["data"]
    assert data["METRICS_ADDRESS"] == "0.0.0.0"
    cert, key, ca = data["METRICS_TLS"].split(",")
    enforce = next(c for c in _spec(objs)["containers"] if c["name"] == "enforce")
    tls = next(m for m in enforce["volumeMounts"] if m["name"] == "metrics-tls")
    assert tls["readOnly"] and {os.path.dirname(p) for p in (cert, key, ca)} == {tls["mountPath"]}
    svc = objs[("Service", "convgpu-metrics")]["spec"]
    assert svc["clusterIP"] == "None" and svc["selector"] == {"app.kubernetes.io/name": "convgpu"}
    assert svc["ports"] == [{"name": "metrics", "port": 9400, "targetPort": "metrics"}]
    sm = objs[("ServiceMonitor", "convgpu")]
    assert sm["apiVersion"] == "monitoring.coreos.com/v1" and sm["metadata"]["namespace"] == "convgpu"
    ep = sm["spec"]["endpoints"][0]
    assert ep["scheme"] == "https" and ep["tlsConfig"]["cert"]["secret"]["name"] == "convgpu-metrics-client"
    np = objs[("NetworkPolicy", "convgpu-metrics")]["spec"]
    assert np["ingress"] == [{"from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}],
                              "ports": [{"protocol": "TCP", "port": 9400}]}]
    # the alert and recording rules, the very groups promtool tests (tests/unit/test_prometheus_rules.py)
    pr = objs[("PrometheusRule", "convgpu")]
    assert pr["apiVersion"] == "monitoring.coreos.com/v1" and pr["metadata"]["namespace"] == "convgpu"
    rules = yaml.safe_load((DEPLOY.parent / "prometheus" / "convgpu-rules.yaml").read_text())
    assert pr["spec"]["groups"] == rules["groups"]
    assert {r["alert"] for g in pr["spec"]["groups"] for r in g["rules"] if "alert" in r} >= {
        "ConvgpuContainerHeldLong", "ConvgpuContainerOverLimitByDriver", "ConvgpuBackstopOff", "ConvgpuEnforcerDown",
        "ConvgpuUnattributedMemory", "ConvgpuGpuNearlyFull"}
    assert len(objs) == 10


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
    assert "ARG BASE=ubuntu:24.04\nFROM ${BASE}" in text and "python3-bpfcc" in text and "--system-site-packages" in text
    assert "pip install --no-cache-dir '/src[k8s]'" in text


def test_the_dra_variant_runs_the_dra_plugin_with_its_sockets_and_rights():
    """deploy/kubernetes/dra (issue 40): the base with `convgpu kube --dra`, the kubelet's plugin
    dirs and the CDI dir mounted at their host paths (the kubelet dials the socket path the plugin
    names), a DeviceClass, and RBAC for the node's ResourceSlice and the claims it prepares."""
    objs = {(d["kind"], d["metadata"]["name"]): d for d in render(DEPLOY / "dra")}
    assert sorted(objs) == [("ClusterRole", "convgpu-dra"), ("ClusterRole", "convgpu-pod-reader"),
                            ("ClusterRoleBinding", "convgpu-dra"), ("ClusterRoleBinding", "convgpu-pod-reader"),
                            ("ConfigMap", "convgpu-options"), ("DaemonSet", "convgpu"),
                            ("DeviceClass", "gpu-memory.convgpu.io"), ("Namespace", "convgpu"), ("ServiceAccount", "convgpu")]
    schema_check([d for d in objs.values() if not d["apiVersion"].startswith("resource.")])
    assert objs[("DeviceClass", "gpu-memory.convgpu.io")]["spec"]["selectors"] == [
        {"cel": {"expression": 'device.driver == "gpu-memory.convgpu.io"'}}]
    assert objs[("ClusterRole", "convgpu-dra")]["rules"] == [
        {"apiGroups": ["resource.k8s.io"], "resources": ["resourceslices"],
         "verbs": ["get", "list", "watch", "create", "update", "delete"]},
        {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims"], "verbs": ["get"]}]
    assert objs[("ClusterRoleBinding", "convgpu-dra")]["subjects"] == [
        {"kind": "ServiceAccount", "name": "convgpu", "namespace": "convgpu"}]
    spec = _spec(objs)
    kube = next(c for c in spec["containers"] if c["name"] == "kube")
    words = shlex.split(kube["args"][0])
    assert words[:4] == ["exec", "convgpu", "kube", "--dra"]
    assert {w for w in words if w.startswith("--")} <= _options("kube")
    mounts = {m["name"]: (m["mountPath"], m.get("readOnly", False)) for m in kube["volumeMounts"]}
    assert mounts == {"kubelet-plugins": ("/var/lib/kubelet/plugins", False),
                      "kubelet-plugins-registry": ("/var/lib/kubelet/plugins_registry", False),
                      "cdi": ("/var/run/cdi", False), "pod-resources": ("/var/lib/kubelet/pod-resources", False),
                      "pod-logs": ("/var/log/pods", True), "container-logs": ("/var/log/containers", True),
                      "run": ("/run/convgpu", False), "tmp": ("/tmp", False)}
    hosts = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    assert all(hosts[n] == p for n, (p, _) in mounts.items() if n in hosts)   # the same path inside and out
    for kind in ("livenessProbe", "readinessProbe"):
        assert kube[kind]["exec"]["command"] == ["python3", "-m", "convgpu.kube.probe", "dra"]
    assert kube["securityContext"]["capabilities"] == {"drop": ["ALL"]}


def test_the_dra_example_asks_12gi_of_a_gpu():
    objs = {(d["kind"], d["metadata"]["name"]): d for d in render(DEPLOY / "dra" / "example")}
    request = objs[("ResourceClaimTemplate", "gpu-12gi")]["spec"]["spec"]["devices"]["requests"][0]
    assert request == {"name": "gpu", "exactly": {"deviceClassName": "gpu-memory.convgpu.io",
                                                  "capacity": {"requests": {"memory": "12Gi"}}}}
    pod = objs[("Pod", "trainer")]["spec"]
    assert pod["resourceClaims"] == [{"name": "gpu", "resourceClaimTemplateName": "gpu-12gi"}]
    assert pod["containers"][0]["resources"] == {"claims": [{"name": "gpu"}]}
