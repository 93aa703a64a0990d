"""The DRA plugin's API objects against the resource.k8s.io/v1 schema of the pinned `kubernetes`
client (pyproject's k8s extra): every field name of the ResourceSlice it publishes, of the claims
it reads and of the deployment's DRA objects must be one the client's models name
(attribute_map: the API's JSON names, openapi_types: what each holds), walked to the leaves.
No field name is written here: they all come from the models."""
import re
import tomllib
from pathlib import Path

import kubernetes
from kubernetes import client as k

from apiserver_double import claim
from convgpu.kube import devices as dv
from convgpu.kube.slices import body

ROOT = Path(__file__).resolve().parents[2]
GiB = 1 << 30


def unknown(doc, model, path="") -> list[str]:
    """The paths in doc whose names the model (and its nested models) does not have."""
    if not isinstance(doc, dict):
        return [f"{path}: {type(doc).__name__}, not an object"]
    names = {json: py for py, json in model.attribute_map.items()}
    out = []
    for key, value in doc.items():
        if key not in names:
            out.append(f"{path}.{key}")
        elif value is not None:
            out += _typed(value, model.openapi_types[names[key]], f"{path}.{key}")
    return out


def _typed(value, t: str, path: str) -> list[str]:
    if t.startswith("List["):
        return [p for i, v in enumerate(value) for p in _typed(v, t[5:-1], f"{path}[{i}]")]
    if t.startswith("Dict[str, "):
        return [p for key, v in value.items() for p in _typed(v, t[10:-1], f"{path}.{key}")]
    model = getattr(k, t, None)
    if model is not None and hasattr(model, "attribute_map"):
        return unknown(value, model, path)
    want = {"str": str, "int": int, "bool": bool, "datetime": str, "object": object}.get(t, object)
    return [] if isinstance(value, want) else [f"{path}: {value!r} is no {t}"]


def test_the_client_is_the_pinned_one():
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["k8s"]
    pin = next(re.fullmatch(r"kubernetes==(.+)", d).group(1) for d in extra if d.startswith("kubernetes"))
    assert kubernetes.__version__ == pin


def test_the_published_slice_is_the_schemas():
    doc = body("node-a", [dv.Gpu(0, 80 * GiB, "GPU-5ca1ab1e-0000-4000-8000-000000000000", 0)], 256 << 20, 3,
               {"GPU-5ca1ab1e-0000-4000-8000-000000000000": {"model": "NVIDIA H200", "architecture": "Hopper",
                                                             "driver": "580.159.04"}})
    assert unknown(doc, k.V1ResourceSlice) == []
    # and it reads into the models and back whole (a misplaced field would be dropped on the way)
    assert k.ApiClient().sanitize_for_serialization(k.V1ResourceSlice.from_dict(doc)) == doc
    device = doc["spec"]["devices"][0]
    assert device[k.V1Device.attribute_map["allow_multiple_allocations"]] is True
    memory = device[k.V1Device.attribute_map["capacity"]]["memory"]
    policy = memory[k.V1DeviceCapacity.attribute_map["request_policy"]]
    assert set(policy[k.V1CapacityRequestPolicy.attribute_map["valid_range"]]) == set(
        k.V1CapacityRequestPolicyRange.attribute_map.values())


def test_a_misspelt_field_is_found():
    doc = body("node-a", [dv.Gpu(0, 80 * GiB)], 256 << 20, 1)
    dev = doc["spec"]["devices"][0]
    dev["allowMultipleAllocation"] = dev.pop(k.V1Device.attribute_map["allow_multiple_allocations"])
    dev["capacity"]["memory"]["requestPolicy"]["validRange"]["stepSize"] = "1Mi"
    assert unknown(doc, k.V1ResourceSlice) == [".spec.devices[0].capacity.memory.requestPolicy.validRange.stepSize",
                                               ".spec.devices[0].allowMultipleAllocation"]


def test_the_claims_the_plugin_reads_are_the_schemas():
    doc = k.ApiClient().sanitize_for_serialization(
        claim("ml", "c", "0c1a1a1a-0000-4000-8000-000000000001", [("p", "0d0d0d0d-1111-2222-3333-444444444444")],
              [("gpu", "gpu-0", "12Gi", "5a")]))
    assert unknown(doc, k.ResourceV1ResourceClaim) == []
    result = doc["status"]["allocation"]["devices"]["results"][0]
    names = k.V1DeviceRequestAllocationResult.attribute_map
    assert (result[names["consumed_capacity"]], result[names["share_id"]]) == ({"memory": "12Gi"}, "5a")


def test_the_dra_deployment_is_the_schemas():
    from test_kube_deploy import DEPLOY, render
    docs = render(DEPLOY / "dra") + render(DEPLOY / "dra" / "example")
    models = {"DeviceClass": k.V1DeviceClass, "ResourceClaimTemplate": k.V1ResourceClaimTemplate, "Pod": k.V1Pod,
              "DaemonSet": k.V1DaemonSet, "ClusterRole": k.V1ClusterRole}
    assert set(models) <= {d["kind"] for d in docs}
    for d in docs:
        if d["kind"] in models:
            assert unknown(d, models[d["kind"]]) == [], (d["kind"], d["metadata"]["name"])
