"""The DRA plugin's pure parts (issue 40): a claim read as convgpu honours it (kube/claims.py),
the sizes a tenant writes (Kubernetes quantities), the CDI spec, the ResourceSlice's devices and
capacity (kube/slices.py), and one agent per GPU (kube/owner.py). Claims are built from the
`kubernetes` client's models (tests/apiserver_double.claim), as the API server serves them."""
import pytest

from apiserver_double import claim
from convgpu.kube import devices as dv
from convgpu.kube import cdi
from convgpu.kube.claims import ClaimError, check_request, device_name, quantity, read
from convgpu.kube.owner import Owner
from convgpu.kube.slices import body, quantity as q

MiB, GiB = 1 << 20, 1 << 30
UID = "0c1a1a1a-0000-4000-8000-000000000001"
POD = "0d0d0d0d-1111-2222-3333-444444444444"
H100 = dv.Gpu(0, 80 * GiB - 512 * MiB, "GPU-5CA1AB1E-0000-4000-8000-000000000000", 0)
DEVICES = {device_name(H100): H100, "gpu-1": dv.Gpu(1, 4 * GiB, "", 1)}


@pytest.mark.parametrize("raw, want", [("12Gi", 12 * GiB), ("1.5G", 1_500_000_000), ("500M", 500_000_000),
                                       ("128e9", 128_000_000_000), ("1536Mi", 1536 * MiB), ("100m", 1),
                                       ("4096", 4096), ("0.5Ki", 512)])
def test_quantities_as_kubernetes_writes_them(raw, want):
    assert quantity(raw, "size") == want


@pytest.mark.parametrize("raw, why", [("", "is not a quantity"), (" 1Gi", "is not a quantity"),
                                      ("12GiB", "is not a quantity (write it like 12Gi"), ("lots", "is not a quantity"),
                                      ("-1Gi", "is not above 0"), ("0", "is not above 0"),
                                      ("9e99999", "is larger than any GPU"), ("1" * 33, "is not a quantity"),
                                      (12, "is not a quantity"), (None, "is not a quantity")])
def test_a_size_that_is_not_a_quantity_is_one_line(raw, why):
    with pytest.raises(ClaimError) as e:
        quantity(raw, "size")
    assert why in str(e.value) and "\n" not in str(e.value)


def _claim(results, pods=(("p", POD),), uid=UID, **kw):
    return claim("ml", "c", uid, list(pods), results, **kw)


def test_a_claim_read_as_it_is_honoured():
    gpu = device_name(H100)
    assert gpu == "gpu-5ca1ab1e-0000-4000-8000-000000000000"
    c = read(_claim([("a", gpu, "12Gi", "s1"), ("b", gpu, "1.5G", None), ("c", "gpu-1", "1Gi", None)]),
             UID, "ml", "c", "node-a", DEVICES)
    assert (c.ref, c.pods) == ("ml/c", (POD,))
    assert [(r.request, r.device, r.bytes, r.share_id) for r in c.results] == [
        ("a", gpu, 12 * GiB, "s1"), ("b", gpu, 1_500_000_000, None), ("c", "gpu-1", GiB, None)]
    # two results on one GPU add up; the enforcer's entry is keyed by the GPU's key
    assert c.wire() == {"claim": "ml/c", "pods": [POD], "gpus": {H100.uuid: 12 * GiB + 1_500_000_000, "gpu1": GiB}}


@pytest.mark.parametrize("obj, why", [
    (_claim([("a", "gpu-1", "1Gi", None)], uid="ffffffff-0000-4000-8000-000000000000"),
     "has uid 'ffffffff-0000-4000-8000-000000000000', not '0c1a1a1a-0000-4000-8000-000000000001' as the kubelet asks"),
    (_claim([("a", "gpu-1", "1Gi", None)], driver="gpu.nvidia.com"), "has no allocation by gpu-memory.convgpu.io"),
    (_claim([("a", "gpu-1", "1Gi", None)], pool="node-b"), "pool 'node-b' is not this node's (node-a)"),
    (_claim([("a", "gpu-7", "1Gi", None)]), "device 'gpu-7' is not a GPU this node has now (lost?)"),
    (_claim([("a", "gpu-1", None, None)]), "no consumedCapacity.memory (the DRAConsumableCapacity feature gate"),
    (_claim([("a", "gpu-1", "5Gi", None)]), "consumedCapacity.memory 5Gi is past GPU gpu1's 4294967296 bytes"),
    (_claim([("a", "gpu-1", "1 Gi", None)]), "consumedCapacity.memory '1 Gi' is not a quantity"),
    (_claim([("a", "gpu-1", "1Gi", "../../etc")]), "shareID '../../etc' is not one"),
    (_claim([("a", "gpu-1", "1Gi", None)], pods=()), "is reserved for no pod"),
    (_claim([("a", "gpu-1", "1Gi", None)] * 33), "has 33 results, more than 32"),
])
def test_a_claim_convgpu_cannot_honour_is_one_line(obj, why):
    with pytest.raises(ClaimError) as e:
        read(obj, UID, "ml", "c", "node-a", DEVICES)
    assert why in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("uid, ns, name", [("../x", "ml", "c"), (UID, "ml", "../../etc"), (UID, "ML", "c"),
                                           ("", "ml", "c"), (UID, "ml", "a" * 254), (UID, "m" * 64, "c")])
def test_the_kubelets_names_are_checked_before_a_path_or_file_is_made_of_them(uid, ns, name):
    with pytest.raises(ClaimError):
        check_request(uid, ns, name)


def test_the_cdi_spec_gives_the_gpus_nodes_and_the_shim(tmp_path):
    for n in ("nvidia1", "nvidiactl", "nvidia-uvm"):
        (tmp_path / n).touch()
    c = read(_claim([("a", "gpu-1", "1Gi", None), ("b", "gpu-1", "512Mi", None)]), UID, "ml", "c", "node-a", DEVICES)
    spec = cdi.spec(c, str(tmp_path), dv.ShimOffer("/run/convgpu/lib/libconvgpu.so", "/run/convgpu/shim"))
    cdi.validate(spec)
    # the least version its contents need: device nodes with a hostPath, a name that starts with a digit
    assert (spec["cdiVersion"], spec["kind"]) == ("0.5.0", "convgpu.io/claim")
    assert spec["devices"] == [{"name": f"{UID}-gpu-1", "containerEdits": {   # one per GPU
        "env": ["NVIDIA_VISIBLE_DEVICES=void"], "deviceNodes": [
            {"path": f"/dev/{n}", "hostPath": str(tmp_path / n)} for n in ("nvidia1", "nvidiactl", "nvidia-uvm")]}}]
    assert spec["containerEdits"]["env"] == [
        "CONVGPU_DRA_CLAIM=ml/c", f"CONVGPU_GPU_MEMORY_LIMIT={1536 * MiB}", "CONVGPU_SHIM_SOCKET=/run/convgpu/shim/shim.sock",
        "LD_PRELOAD=/opt/convgpu/libconvgpu.so"]
    assert spec["containerEdits"]["mounts"] == [
        {"hostPath": "/run/convgpu/lib/libconvgpu.so", "containerPath": "/opt/convgpu/libconvgpu.so",
         "options": ["ro", "nosuid", "nodev", "bind"]},
        {"hostPath": "/run/convgpu/shim", "containerPath": "/run/convgpu/shim", "options": ["ro", "nosuid", "nodev", "bind"]}]


def test_the_slice_publishes_each_gpu_once_with_its_memory_in_steps_of_the_unit():
    odd = dv.Gpu(2, 81559 * MiB - 512 * MiB, "GPU-odd", 2)          # an H100's 81559 MiB less the reserve
    tiny = dv.Gpu(3, 100 * MiB, "", 3)                               # below one unit: not published
    doc = body("node-a", [H100, odd, tiny], 256 * MiB, 7, {H100.key: {"model": "NVIDIA H100 80GB HBM3",
                                                                     "architecture": "Hopper", "driver": "580.159.04"}})
    spec = doc["spec"]
    assert (doc["metadata"]["name"], spec["driver"], spec["nodeName"], spec["pool"]) == (
        "node-a-gpu-memory.convgpu.io", "gpu-memory.convgpu.io", "node-a",
        {"name": "node-a", "generation": 7, "resourceSliceCount": 1})
    a, b = spec["devices"]
    assert a["allowMultipleAllocations"] is True and a["capacity"] == {"memory": {"value": "81408Mi", "requestPolicy": {
        "default": "81408Mi", "validRange": {"min": "256Mi", "max": "81408Mi", "step": "256Mi"}}}}
    assert a["attributes"] == {"index": {"int": 0}, "convgpuVersion": {"version": "0.1.0"}, "uuid": {"string": H100.uuid},
                               "model": {"string": "NVIDIA H100 80GB HBM3"}, "architecture": {"string": "Hopper"},
                               "driverVersion": {"string": "580.159.04"}}
    # 81047 MiB is no multiple of 256 MiB: the range ends at the last step below it, 80896 MiB
    assert b["capacity"]["memory"]["value"] == "81047Mi" and b["capacity"]["memory"]["requestPolicy"]["validRange"]["max"] == "79Gi"
    assert (q(GiB), q(3 * MiB), q(1000)) == ("1Gi", "3Mi", "1000")


def test_one_agent_per_gpu(tmp_path):
    plugin, dra = Owner(str(tmp_path), "device-plugin"), Owner(str(tmp_path), "dra")
    g0, g1 = dv.Gpu(0, GiB, "GPU-a"), dv.Gpu(1, GiB, "GPU-b")
    assert plugin.filter([g0]) == [g0]
    assert dra.filter([g0, g1]) == [g1]
    assert dra.refused == {"GPU-a": f"the device-plugin (pid {__import__('os').getpid()})"}
    plugin.close()                                    # the device plugin's agent is gone (or killed)
    assert dra.filter([g0, g1]) == [g0, g1] and dra.refused == {}
    dra.close()


def test_an_admin_access_claim_holds_no_share():
    """adminAccess (a monitoring pod's claim) is allocated beside the shares, counted by no one:
    read without a consumedCapacity, it holds 0 bytes, and its spec carries no shim and no limit."""
    c = read(_claim([("mon", "gpu-1", None, None)], admin=True), UID, "ml", "c", "node-a", DEVICES)
    assert [(r.admin, r.bytes) for r in c.results] == [(True, 0)] and c.gpus() == {}
    spec = cdi.spec(c, "/nonexistent", dv.ShimOffer("/run/convgpu/lib/libconvgpu.so", "/run/convgpu/shim"))
    cdi.validate(spec)
    assert spec["containerEdits"] == {"env": ["CONVGPU_DRA_CLAIM=ml/c"]}
    assert spec["devices"] == [{"name": f"{UID}-gpu-1", "containerEdits": {"env": ["NVIDIA_VISIBLE_DEVICES=void"]}}]


GOOD = {"cdiVersion": "0.5.0", "kind": "convgpu.io/claim", "containerEdits": {"env": ["A=1"]},
        "devices": [{"name": "0abc-gpu-1", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia1",
                                                                                "hostPath": "/dev/nvidia1"}]}}]}


def _with(path, value):
    import copy
    doc = copy.deepcopy(GOOD)
    at = doc
    for k in path[:-1]:
        at = at[k]
    if value is KeyError:
        del at[path[-1]]
    else:
        at[path[-1]] = value
    return doc


@pytest.mark.parametrize("doc, why", [
    # what the container-device-interface library refuses (pkg/cdi spec.go, device.go, container-edits.go,
    # pkg/parser, specs-go/version.go): the empty device edits issue 48 found first
    (_with(("devices", 0, "containerEdits"), {"deviceNodes": []}), "invalid device, empty device edits"),
    (_with(("devices", 0, "containerEdits"), {}), "invalid device, empty device edits"),
    (_with(("devices",), []), "invalid spec, no devices"),
    (_with(("cdiVersion",), "0.2.0"), "invalid version '0.2.0'"),
    (_with(("cdiVersion",), "0.4.0"), "the spec version must be at least v0.5.0"),    # hostPath, a digit first
    (_with(("cdiVersion",), KeyError), "invalid version None"),
    (_with(("kind",), "convgpu.io"), "invalid kind 'convgpu.io'"),
    (_with(("kind",), "-convgpu.io/claim"), "invalid kind"),
    (_with(("devices", 0, "name"), "gpu/1"), "invalid device name 'gpu/1'"),
    (_with(("devices",), [GOOD["devices"][0]] * 2), "invalid spec, multiple device '0abc-gpu-1'"),
    (_with(("containerEdits", "env"), ["=1"]), "invalid environment variable '=1'"),
    (_with(("containerEdits", "env"), ["NOVALUE"]), "invalid environment variable 'NOVALUE'"),
    (_with(("devices", 0, "containerEdits", "deviceNodes", 0, "path"), ""), "invalid (empty) device path"),
    (_with(("devices", 0, "containerEdits", "deviceNodes", 0, "type"), "x"), "invalid type 'x'"),
    (_with(("devices", 0, "containerEdits", "deviceNodes", 0, "permissions"), "rwx"), "invalid permissions 'rwx'"),
    (_with(("containerEdits", "mounts"), [{"hostPath": "/a", "containerPath": ""}]), "invalid mount, empty container path"),
    (_with(("containerEdits", "hooks"), [{"hookName": "whenever", "path": "/x"}]), "invalid hook name 'whenever'"),
    (_with(("containerEdits", "devices"), []), "unknown field 'devices'"),   # decoded strictly
    (_with(("devices", 0, "ociEdits"), {}), "unknown field 'ociEdits'"),
])
def test_a_spec_a_runtime_would_refuse_is_refused_here(doc, why):
    cdi.validate(GOOD)
    with pytest.raises(cdi.CdiError) as e:
        cdi.validate(doc)
    assert why in str(e.value) and "\n" not in str(e.value)


def test_the_cdi_librarys_own_examples():
    """schema/testdata of container-device-interface: the good ones pass, the bad ones do not."""
    cdi.validate({"cdiVersion": "0.3.0", "kind": "vendor.com/device", "devices": [
        {"name": "myDevice", "containerEdits": {"deviceNodes": [{"path": "/dev/card1"}]}}]})
    for bad in ({}, {"cdiVersion": "0.3.0", "kind": "vendor.com/device", "devices": []}):
        with pytest.raises(cdi.CdiError):
            cdi.validate(bad)
    assert cdi.minimum_version({"kind": "vendor.com/device", "devices": [{"name": "myDevice"}]}) == "0.3.0"
    assert cdi.minimum_version({"kind": "vendor.com/dev.ice", "devices": []}) == "0.6.0"
