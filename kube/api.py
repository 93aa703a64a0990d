"""The kubelet's gRPC APIs, compiled from the .proto files beside this module when first used.

Why compiled at import and not generated modules committed: protobuf's generated Python checks
the runtime it runs on (gencode newer than the runtime is refused), so committed *_pb2.py files
tie the package to one protobuf range, and a regenerate step at install time needs a build hook
in every install path (editable, wheel, the container image). grpcio-tools's protoc, run in
process by grpc.protos_and_services, builds the descriptors from the committed .proto for
whatever protobuf is installed: the .proto files are the only source, nothing can drift, and it
costs about 0.1 s once per process. grpcio-tools is in the `k8s` extra with grpcio."""
import os
import sys
import threading

DEVICE_PLUGIN_VERSION = "v1beta1"      # RegisterRequest.version the kubelet accepts
KUBELET_SOCKET = "kubelet.sock"        # the kubelet's Registration socket, in the plugin dir
HEALTHY, UNHEALTHY = "Healthy", "Unhealthy"
# DRA (kube/dra.py): the plugin type and the services named in PluginInfo.supported_versions, as
# "<proto package's last part>.<service>"; the kubelet takes the first of them it speaks
DRA_PLUGIN_TYPE = "DRAPlugin"
DRA_VERSIONS = ("v1", "v1beta1")
DRA_SERVICES = tuple(f"{v}.DRAPlugin" for v in DRA_VERSIONS)

_lock = threading.Lock()
_loaded: dict[str, tuple] = {}


def _load(name: str):
    with _lock:
        if name not in _loaded:
            try:
                import grpc
            except ImportError:
                from ..errors import PrerequisiteError
                raise PrerequisiteError("the Kubernetes agent needs grpcio and grpcio-tools",
                                        "pip install 'convgpu[k8s]'") from None
            here = os.path.dirname(os.path.abspath(__file__))
            # protos_and_services resolves the file through sys.path; only this folder is added,
            # and only for the call
            sys.path.insert(0, here)
            try:
                _loaded[name] = grpc.protos_and_services(name)
            finally:
                sys.path.remove(here)
        return _loaded[name]


def deviceplugin():
    """(messages, services) of deviceplugin v1beta1."""
    return _load("deviceplugin.proto")


def podresources():
    """(messages, services) of podresources v1."""
    return _load("podresources.proto")


def dra(version: str = "v1"):
    """(messages, services) of the kubelet's DRAPlugin service, v1 or v1beta1 (one message set
    each: v1 adds Device.share_id)."""
    if version not in DRA_VERSIONS:
        raise ValueError(f"no DRA service {version!r}")
    return _load(f"dra_{version}.proto")


def registration():
    """(messages, services) of plugin registration v1 (package `pluginregistration`)."""
    return _load("pluginregistration.proto")


def drahealth():
    """(messages, services) of the DRA health service v1alpha1."""
    return _load("drahealth.proto")


def unix(path: str) -> str:
    """A gRPC target / listen address for a UNIX socket path."""
    return "unix://" + os.path.abspath(path)
