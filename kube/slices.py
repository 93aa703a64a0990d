"""The node's ResourceSlice (resource.k8s.io/v1): one device per GPU, shareable
(`allowMultipleAllocations: true`) with a consumable `memory` capacity of what convgpu hands out
on it (the card less --reserve, or --gpu-memory: the enforcer's capacity; each process's CUDA
context is charged inside its claim, so no room is kept for contexts beside it). A claim asks
`capacity.requests.memory: 12Gi`; the scheduler rounds it up to the request policy's step
(--unit) and keeps the sum of the shares on a GPU within the capacity (KEP-5075). A claim that
asks nothing gets the default: the whole card, as a claim for "a GPU" means.

`body` is pure (tests/unit/test_dra_slices.py); `Slices` publishes it through the `kubernetes`
client: made or replaced when the GPUs change (a new pool generation, which tells the
scheduler that older slices of the pool are stale), withdrawn when the agent stops."""
import hashlib
import logging

from .. import __version__
from . import devices as dv
from .claims import CAPACITY, DRIVER, device_name

log = logging.getLogger(__name__)


def quantity(n: int) -> str:
    """Bytes as a Kubernetes quantity, exact: 80Gi, 256Mi, else the plain number."""
    for shift, suffix in ((40, "Ti"), (30, "Gi"), (20, "Mi")):
        if n and n % (1 << shift) == 0:
            return f"{n >> shift}{suffix}"
    return str(n)


def slice_name(node: str, driver: str = DRIVER) -> str:
    name = f"{node}-{driver}"
    return name if len(name) <= 253 else f"{hashlib.sha256(node.encode()).hexdigest()[:16]}-{driver}"


def device(g: dv.Gpu, unit: int, facts: dict) -> dict | None:
    """One GPU as a shareable device; None when its capacity is below one unit."""
    top = g.capacity // unit * unit   # validRange.max and the default: multiples of the step
    if top < unit:
        return None
    attrs = {"index": {"int": g.index}, "convgpuVersion": {"version": __version__}}
    for name, value in (("uuid", g.uuid), ("model", facts.get("model")), ("architecture", facts.get("architecture")),
                        ("driverVersion", facts.get("driver"))):
        if value:
            attrs[name] = {"string": str(value)[:64]}   # a string attribute holds at most 64 characters
    return {"name": device_name(g), "allowMultipleAllocations": True, "attributes": attrs,
            "capacity": {CAPACITY: {"value": quantity(g.capacity), "requestPolicy": {
                "default": quantity(top),
                "validRange": {"min": quantity(unit), "max": quantity(top), "step": quantity(unit)}}}}}


def body(node: str, gpus: list, unit: int, generation: int, facts: dict | None = None,
         driver: str = DRIVER) -> dict:
    """The ResourceSlice of this node's pool (the pool is named after the node; one slice).
    facts: {GPU key: {"model", "architecture", "driver"}} (NVML's, where known)."""
    facts = facts or {}
    devs = [d for g in gpus if (d := device(g, unit, facts.get(g.key, {}))) is not None]
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": slice_name(node, driver)},
            "spec": {"driver": driver, "nodeName": node,
                     "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
                     "devices": devs}}


class Slices:
    """Publishes this node's slice; every call raises the API's error (the agent retries)."""

    def __init__(self, api_client, node: str, unit: int, driver: str = DRIVER):
        from kubernetes import client
        self.api = client.ResourceV1Api(api_client)
        self.node, self.unit, self.driver = node, unit, driver
        self.name = slice_name(node, driver)
        self.generation = 0
        self.published: list | None = None     # the devices as last published
        self.publishes = 0

    def _current(self):
        """Our slices now on the API server: the one we write (or None), and others of this
        node and driver (a former name) that must go."""
        got = self.api.list_resource_slice(
            field_selector=f"spec.nodeName={self.node},spec.driver={self.driver}", _request_timeout=10)
        ours = [s for s in got.items if s.spec.node_name == self.node and s.spec.driver == self.driver]
        return (next((s for s in ours if s.metadata.name == self.name), None),
                [s for s in ours if s.metadata.name != self.name])

    def publish(self, gpus: list, facts: dict | None = None) -> bool:
        """Make the API server's slice say these GPUs; True when it was written."""
        from kubernetes import client
        want = body(self.node, gpus, self.unit, 0, facts, self.driver)["spec"]["devices"]
        if want == self.published:
            return False
        mine, stale = self._current()
        for s in stale:
            self.api.delete_resource_slice(s.metadata.name, _request_timeout=10)
        if mine is not None:
            self.generation = max(self.generation, mine.spec.pool.generation or 0)
        self.generation += 1
        doc = body(self.node, gpus, self.unit, self.generation, facts, self.driver)
        if mine is None:
            self.api.create_resource_slice(client.V1ResourceSlice.from_dict(doc), _request_timeout=10)
        else:
            doc["metadata"]["resourceVersion"] = mine.metadata.resource_version
            self.api.replace_resource_slice(self.name, client.V1ResourceSlice.from_dict(doc), _request_timeout=10)
        self.published = want
        self.publishes += 1
        log.info("ResourceSlice %s generation %d: %s", self.name, self.generation,
                 ", ".join(f"{d['name']} {d['capacity'][CAPACITY]['value']}" for d in want) or "no GPU")
        return True

    def withdraw(self):
        from kubernetes.client.exceptions import ApiException
        try:
            self.api.delete_resource_slice(self.name, _request_timeout=10)
        except ApiException as e:
            if e.status != 404:
                raise
        self.published = None
