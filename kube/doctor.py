"""`convgpu doctor`'s Kubernetes section: the kubelet's sockets, our resource registered (our
socket answering with its units and how many are unhealthy, and the kubelet's checkpoint listing
the resource's devices), pods seen through the pod-resources API, the enforcer's loop answering;
on a DRA node (our registration socket in plugins_registry) the DRA plugin's GetInfo instead.
Every check is advisory: tracing works without Kubernetes. The DaemonSet mounts the kubelet's
two socket dirs read-only into the enforcer's container too, so that one `kubectl exec ... -c
enforce -- convgpu doctor` checks BPF, the kubelet, the plugin and the enforcer together."""
import json
import os

from . import api, devices as dv
from .pods import POD_RESOURCES
from .claims import DRIVER
from .dra import REGISTRY_DIR
from .plugin import ENDPOINT

PLUGIN_DIR = "/var/lib/kubelet/device-plugins"
CHECKPOINT = "kubelet_internal_checkpoint"   # the device manager's record of resources and grants


def checks(plugin_dir: str = PLUGIN_DIR, pod_resources: str = POD_RESOURCES,
           resource: str = dv.RESOURCE, run_dir: str = "/run/convgpu",
           registry_dir: str = REGISTRY_DIR) -> list[tuple[str, bool, str, str]]:
    """[(name, ok, detail, fix)]; one line only when this host runs no kubelet."""
    reg = os.path.join(registry_dir, f"{DRIVER}-reg.sock")
    if os.path.exists(reg):   # the DRA plugin (kube/dra.py) serves this node
        return [_dra(reg)] + _enforcer(run_dir)
    kubelet = os.path.join(plugin_dir, api.KUBELET_SOCKET)
    if not os.path.exists(kubelet) and not os.path.exists(pod_resources):
        return [("kubernetes", False, f"no kubelet sockets ({kubelet}, {pod_resources})",
                 "only on a Kubernetes node: deploy with docs/KUBERNETES.md")]
    up = os.path.exists(kubelet)
    out = [("kubelet device plugins", up, kubelet,
            "" if up else "the kubelet is not running, or its root dir is not /var/lib/kubelet")]
    try:
        import grpc
        api.deviceplugin()
    except Exception as e:
        return out + [("grpc", False, str(e)[:200], "pip install 'convgpu[k8s]'")]
    ours = os.path.join(plugin_dir, ENDPOINT)
    m, s = api.deviceplugin()
    try:
        with grpc.insecure_channel(api.unix(ours)) as ch:
            stream = s.DevicePluginStub(ch).ListAndWatch(m.Empty(), timeout=3)
            devices = next(iter(stream)).devices
            stream.cancel()
        bad = sum(d.health != api.HEALTHY for d in devices)
        out.append((f"{resource} plugin", bad == 0, f"{ours}: {len(devices)} units" + (f", {bad} unhealthy" if bad else ""),
                    "" if bad == 0 else "a GPU's XID or NVML error: see `convgpu kube`'s log and nvidia-smi -q"))
    except Exception as e:
        out.append((f"{resource} plugin", False, f"{ours}: {_why(e)}", "run `convgpu kube` (the DaemonSet's kube container)"))
    try:
        with open(os.path.join(plugin_dir, CHECKPOINT)) as f:
            registered = json.load(f).get("Data", {}).get("RegisteredDevices", {}) or {}
        n = len(registered.get(resource, []))
        out.append((f"{resource} registered", n > 0, f"the kubelet's checkpoint lists {n} devices",
                    "" if n else "the kubelet has not taken our registration: see `convgpu kube`'s log"))
    except (OSError, ValueError) as e:
        out.append((f"{resource} registered", False, f"kubelet checkpoint: {_why(e)}", "the kubelet has not written it yet"))
    try:
        from .pods import list_assigned
        got = list_assigned(pod_resources, resource, timeout=3)
        pods = {(a.namespace, a.pod) for a in got}
        with_units = [a for a in got if a.devices]
        out.append(("pods seen", True, f"{len(pods)} pods, {len(with_units)} containers with {resource} "
                    f"({sum(len(a.devices) for a in with_units)} units)", ""))
    except Exception as e:
        out.append(("pods seen", False, f"{pod_resources}: {_why(e)}", "the kubelet's pod-resources API (on by default since 1.15)"))
    return out + _enforcer(run_dir)


def _enforcer(run_dir: str) -> list:
    try:
        from .probe import enforcer
        return [("enforcer", True, enforcer(run_dir), "")]
    except (OSError, ValueError, RuntimeError) as e:
        return [("enforcer", False, f"{run_dir}/control.sock: {e}", "the DaemonSet's enforce container: see its log")]


def _dra(reg: str) -> tuple:
    """The DRA plugin answers on its registration socket as the kubelet asks it (GetInfo)."""
    try:
        import grpc
        m, s = api.registration()
        with grpc.insecure_channel(api.unix(reg)) as ch:
            info = s.RegistrationStub(ch).GetInfo(m.InfoRequest(), timeout=3)
        return (f"DRA driver {DRIVER}", True, f"{reg}: endpoint {info.endpoint}, services "
                f"{', '.join(info.supported_versions)}", "")
    except Exception as e:
        return (f"DRA driver {DRIVER}", False, f"{reg}: {_why(e)}", "run `convgpu kube --dra` (the DRA DaemonSet's kube container)")


def _why(e: Exception) -> str:
    details = getattr(e, "details", None)
    return (details() if callable(details) else None) or str(e)[:200] or type(e).__name__
