"""`convgpu kube`: the Kubernetes node agent next to `convgpu enforce` (docs/KUBERNETES.md).
Serves the convgpu.io/gpu-memory device plugin to the kubelet and sends each pod's limit (its
units x --unit, or its convgpu.io/gpu-memory-limit annotation) to the enforcer; with --dra, the
DRA kubelet plugin instead (kube/dra.py): a ResourceSlice with a consumable memory capacity per
GPU, and each claim's share held by the enforcer."""
import logging
import os

import typer

from ..errors import ConfigError
from ..kube.dra import CDI_DIR, PLUGINS_DIR, REGISTRY_DIR   # no gRPC at import: the defaults only
from ..units import parse_size
from . import common

log = logging.getLogger("convgpu.cli.kube")
PLUGIN_DIR = "/var/lib/kubelet/device-plugins"


@common.handle_errors
def kube(
    unit: str = typer.Option("256MiB", "--unit", help="GPU memory per unit of convgpu.io/gpu-memory (a pod asking 16 gets 16 units)."),
    gpu_memory: str = typer.Option(None, "--gpu-memory", help="Memory shared per GPU (default: NVML's total minus --reserve; give the enforcer's value)."),
    reserve: str = typer.Option("512MiB", "--reserve", help="Kept free per GPU when the capacity comes from NVML (as the enforcer's --reserve)."),
    resource: str = typer.Option("convgpu.io/gpu-memory", "--resource", help="The extended resource name."),
    plugin_dir: str = typer.Option(PLUGIN_DIR, "--plugin-dir", help="The kubelet's device-plugins dir (kubelet.sock and our socket)."),
    pod_resources: str = typer.Option("/var/lib/kubelet/pod-resources/kubelet.sock", "--pod-resources", help="The kubelet's pod-resources socket."),
    api: str = typer.Option("auto", "--api", help="Pods' annotations and container ids from the API server: auto (when the kubernetes client and a config are there), on, off."),
    node_name: str = typer.Option(None, "--node-name", envvar="NODE_NAME", help="This node's name (the DaemonSet sets NODE_NAME)."),
    log_root: str = typer.Option("/var/log", "--log-root", help="Where the kubelet keeps pods/ and containers/ logs (container ids without the API server)."),
    limits: bool = typer.Option(True, "--limits/--no-limits", help="Send pods' limits to the enforcer (off: device plugin only)."),
    sync: float = typer.Option(2.0, "--sync", min=0.1, help="Seconds between pod-resources listings."),
    duration: float = typer.Option(0.0, "--duration", min=0.0, help="Stop after this many seconds (0: until SIGTERM)."),
    run_dir: str = typer.Option("/run/convgpu", "--run-dir", help="The enforcer's run dir (control.sock)."),
    host_run_dir: str = typer.Option(None, "--host-run-dir", help="The run dir's path on the host, when this container mounts it elsewhere (Allocate mounts the shim from there)."),
    shim: bool = typer.Option(True, "--shim/--no-shim", help="Allocate mounts the preload shim (read-only) and sets LD_PRELOAD: the pod's cudaMemGetInfo reports its limit (docs/SHIM.md)."),
    cdi: str = typer.Option("nvidia.com/gpu", "--cdi", help="CDI kind of the GPUs' devices returned by Allocate (empty: none)."),
    recover_after: float = typer.Option(60.0, "--recover-after", min=0.0, help="Seconds after a GPU's last critical XID before its units are healthy again (if NVML answers for it)."),
    inventory_every: float = typer.Option(5.0, "--inventory-every", min=0.1, help="Seconds between reads of the GPUs (inventory and health)."),
    dra: bool = typer.Option(False, "--dra", help="Serve the DRA kubelet plugin (driver gpu-memory.convgpu.io, Kubernetes 1.34+) instead of the device plugin."),
    registry_dir: str = typer.Option(REGISTRY_DIR, "--registry-dir", help="--dra: the kubelet's plugin registration dir."),
    plugins_dir: str = typer.Option(PLUGINS_DIR, "--plugins-dir", help="--dra: the kubelet's plugins dir (our socket in <dir>/gpu-memory.convgpu.io/)."),
    cdi_dir: str = typer.Option(CDI_DIR, "--cdi-dir", help="--dra: where the per-claim CDI specs go (the runtime's CDI dir)."),
):
    """Kubernetes node agent: the convgpu.io/gpu-memory device plugin and limits from pods."""
    from ..kube.agent import Agent, offer_shim
    from ..kube.health import NodeGpus
    from ..kube.owner import Owner
    from ..kube.plugin import DevicePlugin
    from ..kube.pods import PodSync
    from ..probes.nvml import Nvml
    common.decisions_visible()
    unit_b = parse_size(unit, "--unit")
    if unit_b < 1 << 20:
        raise ConfigError(f"--unit {unit} is below 1 MiB", "give a unit like 256MiB")
    gm = parse_size(gpu_memory, "--gpu-memory") if gpu_memory is not None else None
    res_b = parse_size(reserve, "--reserve")
    nvml = Nvml()
    node = NodeGpus(nvml, gm, res_b, recover_after)
    owner = Owner(run_dir, "dra" if dra else "device-plugin")
    try:   # a refusal below lets go of the GPUs at once (the owner's lock), not at the process's exit
        gpus = owner.filter(node.read())
        if not gpus:
            raise ConfigError(f"no GPU to advertise ({nvml.error or 'NVML lists none'}"
                              f"{'; held by the other agent: ' + ', '.join(owner.refused) if owner.refused else ''})",
                              "run on a GPU node, or give --gpu-memory for one GPU")
        offer = offer_shim(run_dir, host_run_dir) if shim else None
        if dra:
            plugin, syncer = _dra(node_name, gpus, unit_b, run_dir, offer, cdi, registry_dir, plugins_dir, cdi_dir,
                                  node, _sources("off" if api == "off" else "on", node_name, log_root), pod_resources)
        else:
            plugin = DevicePlugin(plugin_dir, gpus, unit_b, resource, shim=offer, cdi_kind=cdi)
            syncer = PodSync(os.path.join(run_dir, "control.sock"), _sources(api, node_name, log_root), unit_b,
                             pod_resources, resource) if limits else None
    except BaseException:
        owner.close()
        nvml.close()
        raise
    plugin.set_health(node.bad())
    common.stop_on_signals()
    agent = Agent(plugin, syncer, lambda: owner.filter(node.read()), sync, inventory_every, bad=node.bad,
                  watch=node.watch)
    log.info("serving %s on %d GPU(s)", "DRA driver gpu-memory.convgpu.io" if dra else
             f"{resource}: {len(plugin.ids)} units of {unit}", len(gpus))
    try:
        agent.run(duration)
    except KeyboardInterrupt:
        pass
    finally:
        agent.stop.set()
        plugin.close()
        owner.close()
        nvml.close()


def _sources(api: str, node_name: str | None, log_root: str) -> list:
    """Where pods' uids, annotations and container ids come from: the API server (a watch), then
    the kubelet's log links."""
    from ..kube.pods import ApiServerPods, KubeletLogPods
    sources = []
    if api not in ("auto", "on", "off"):
        raise ConfigError(f"invalid --api {api!r}", "give auto, on or off")
    if api != "off":
        try:
            if not node_name:
                raise ConfigError("no node name", "set NODE_NAME or --node-name")
            sources.append(ApiServerPods(node_name))
        except Exception as e:
            if api == "on":
                raise ConfigError(f"cannot read pods from the API server: {e}", _api_fix(e)) from None
            log.warning("API server not used (%s): no annotations; container ids from %s", e, log_root)
    sources.append(KubeletLogPods(log_root))
    return sources


def _api_fix(e: Exception) -> str:
    """The fix for an API server that cannot be used: the extra where the client is missing,
    else where its configuration comes from (issue 52: the extra was named when installed)."""
    if isinstance(e, ImportError):
        return "pip install 'convgpu[k8s]' (the kubernetes client)"
    return ("run in the DaemonSet (its service account), or set KUBECONFIG to a kubeconfig; the service account "
            "must be allowed what deploy/kubernetes/base/rbac.yaml allows")


def _dra(node_name, gpus, unit, run_dir, offer, cdi, registry_dir, plugins_dir, cdi_dir, node, sources, pod_resources):
    """The DRA plugin and its matching round, over the API server (claims, the ResourceSlice)."""
    from ..kube.dra import CdiDir, DraPlugin, Enforcer
    from ..kube.drasync import ClaimSync
    from ..kube.pods import api_client
    from ..kube.slices import Slices
    if not node_name:
        raise ConfigError("--dra needs this node's name (the pool and the ResourceSlice are named after it)",
                          "set NODE_NAME or --node-name")
    kubelet = os.path.dirname(os.path.abspath(registry_dir))
    if not os.path.isdir(registry_dir) and not os.path.isdir(kubelet):   # nothing made on a host that is no node
        raise ConfigError(f"no kubelet on this host: {kubelet} is missing",
                          "run `convgpu kube --dra` on a Kubernetes node (the DaemonSet does), or give --registry-dir")
    try:
        client = api_client()
    except Exception as e:
        raise ConfigError(f"--dra needs the API server (claims, the ResourceSlice): {e}", _api_fix(e)) from None
    from kubernetes.client import ResourceV1Api
    claims = ResourceV1Api(client)
    enforcer = Enforcer(os.path.join(run_dir, "control.sock"))
    plugin = DraPlugin(node_name, gpus,
                       lambda ns, name: claims.read_namespaced_resource_claim(name, ns, _request_timeout=10),
                       enforcer, CdiDir(cdi_dir), registry_dir, plugins_dir, slices=Slices(client, node_name, unit),
                       shim=offer, cdi_kind=cdi, facts=lambda: node.facts)
    return plugin, ClaimSync(enforcer, sources, pod_resources, settle=plugin.settle)
