"""Prometheus metrics of the enforcer's state (`--metrics-port`), through prometheus_client.

The library owns the exposition: both formats (Prometheus text 0.0.4 and OpenMetrics, chosen
from the scrape's Accept header), the escaping of label values (a container's name is whatever
its owner typed, quotes and newlines included), gzip and `?name[]=` filtering. convgpu only says
what the metrics are: a Collector turns the latest published status into metric families when
a scrape asks, in a registry of its own (the global one would also carry the process's own
metrics, and a second enforcer in one interpreter, as in the tests, would clash there).

The loop thread publishes a snapshot (status(), the probes' per-process rows, NVML's measured
excess); the HTTP threads only read the last one, so a scrape never touches BPF maps or the
enforcer's books while the loop changes them. NVML's per-GPU used/total is read at scrape time,
as dcgm-exporter does: NVML is thread-safe and holds nothing of ours."""
import logging

from prometheus_client import start_http_server
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from ..probes.nvml import GpuInfo

log = logging.getLogger(__name__)

C_LABELS = ("container", "id", "gpu")   # a container's row on one GPU
P_LABELS = ("pid", "container", "id", "gpu")   # a process on one GPU (id: names need not be unique)
NO_GPU = GpuInfo(index=0, name="", total=0, used=0)   # describe(): a row, so NVML's families are named

GAUGES = (   # name, help, field of a container's per-GPU row (or the container's)
    ("convgpu_container_limit_bytes", "L_c: the container's GPU-memory limit", "limit"),
    ("convgpu_container_assigned_bytes", "A_c: memory assigned to the container", "assigned"),
    ("convgpu_container_used_bytes", "live device allocations of the container's processes", "used"),
    ("convgpu_container_context_overhead_bytes", "CUDA context overhead charged to the container",
     "context_overhead"),
    ("convgpu_container_stalled_seconds", "time the container has spent stalled", "stalled_s"),
    ("convgpu_container_waiting", "1 while the container has a request stalled on the GPU", "waiting"),
)
COUNTERS = (   # per container; the family's name gets `_total` on the wire
    ("convgpu_stalls", "times the container was stalled", "stalls"),
    ("convgpu_grants", "grants the policy gave the container", "grants"),
    ("convgpu_over_limit", "requests above the container's limit", "over_limit_events"),
)


def families(status: dict, usage=(), excess=None, gpus=()) -> list:
    """The metric families of one snapshot. status: Enforcer.status(); usage: the probes' rows
    (pid, dev, live, contexts); excess: (pid, dev) -> NVML's bytes beyond what the probes track
    (the context's real size less the per-context charge); gpus: probes.nvml.GpuInfo rows."""
    excess = excess or {}
    out = []
    for name, text, key in GAUGES:
        g = GaugeMetricFamily(name, text, labels=C_LABELS)
        for c in status["containers"]:
            for dev, row in c["gpus"].items():
                value = row.get(key, c.get(key))
                if value is not None:   # a field the status lacks gives no sample, not a wrong one
                    g.add_metric([c["name"], c["id"], dev], value)
        out.append(g)
    for name, text, key in COUNTERS:
        m = CounterMetricFamily(name, text, labels=("container", "id"))
        for c in status["containers"]:
            m.add_metric([c["name"], c["id"]], c[key])
        out.append(m)

    # per process: the probes' rows, placed in their container by the status's pid lists
    owner = {pid: c for c in status["containers"] for pid in c.get("pids", ())}
    used = GaugeMetricFamily("convgpu_process_memory_used_bytes",
                             "live device allocations of the process", labels=P_LABELS)
    ctx = GaugeMetricFamily("convgpu_process_context_overhead_bytes",
                            "CUDA context overhead of the process: the per-context charge plus "
                            "what NVML measured beyond it", labels=P_LABELS)
    waiting = GaugeMetricFamily("convgpu_process_waiting", "1 while the process is stalled on the GPU",
                                labels=P_LABELS)
    seen = set()
    for u in usage:
        c = owner.get(u.pid)
        dev = str(u.dev)
        lab = [str(u.pid), c["name"] if c else "", c["id"] if c else "", dev]
        used.add_metric(lab, u.live)
        ctx.add_metric(lab, max(u.contexts, 0) * status.get("ctx_overhead", 0) + excess.get((u.pid, u.dev), 0))
        stalled = bool(c) and u.pid in c["gpus"].get(dev, {}).get("waiting_pids", ())
        waiting.add_metric(lab, int(stalled))
        seen.add((u.pid, dev))
    for c in status["containers"]:   # stopped before the probes had a row for it (its first call)
        for dev, row in c["gpus"].items():
            for pid in row.get("waiting_pids", ()):
                if (pid, dev) not in seen:
                    waiting.add_metric([str(pid), c["name"], c["id"], dev], 1)
    out += [used, ctx, waiting]

    # per GPU: convgpu's books, then the card as NVML sees it (dcgm-exporter's FB used/total)
    cap = GaugeMetricFamily("convgpu_gpu_capacity_bytes", "memory shared on the GPU", labels=("gpu",))
    asg = GaugeMetricFamily("convgpu_gpu_assigned_bytes", "memory assigned to containers on the GPU",
                            labels=("gpu",))
    for dev, g in status["gpus"].items():
        cap.add_metric([dev], g["capacity"])
        if "assigned" in g:
            asg.add_metric([dev], g["assigned"])
    out += [cap, asg]
    if gpus:
        total = GaugeMetricFamily("convgpu_gpu_memory_total_bytes", "the GPU's memory (NVML)", labels=("gpu",))
        nv_used = GaugeMetricFamily("convgpu_gpu_memory_used_bytes", "the GPU's memory in use, by anyone (NVML)",
                                    labels=("gpu",))
        info = InfoMetricFamily("convgpu_gpu", "the GPU's model and UUID (NVML), to join with dcgm-exporter",
                                labels=("gpu",))
        for g in gpus:
            total.add_metric([str(g.index)], g.total)
            nv_used.add_metric([str(g.index)], g.used)
            info.add_metric([str(g.index)], {"uuid": g.uuid, "name": g.name})
        out += [total, nv_used, info]
    if "unchecked_calls" in status:
        out.append(CounterMetricFamily("convgpu_unchecked_calls", "allocations and contexts BPF let through "
                                       "unchecked while the enforcer's heartbeat had lapsed",
                                       value=status["unchecked_calls"]))
    return out


class StatusCollector(Collector):
    """Families from the last published snapshot, made when a scrape asks."""

    def __init__(self, nvml=None):
        self.nvml = nvml
        self.latest = ({"containers": [], "gpus": {}}, (), {})

    def publish(self, status: dict, usage=(), excess=None) -> None:
        self.latest = (status, tuple(usage), dict(excess or {}))   # one swap: a scrape sees old or new, whole

    def describe(self):
        """Every family's name, NVML's too, without reading anything: the registry serves
        `?name[]=` filtering (and refuses a clash of names) from these."""
        return families({"containers": [], "gpus": {}, "unchecked_calls": 0}, gpus=(NO_GPU,))

    def collect(self):
        status, usage, excess = self.latest
        gpus = ()
        if self.nvml is not None and self.nvml.ok:
            try:
                gpus = self.nvml.gpus()
            except Exception as e:   # a driver hiccup, or NVML shut down under a late scrape
                log.debug("metrics: NVML: %s", e)
        return families(status, usage, excess, gpus)


def render(status: dict, usage=(), excess=None, gpus=()) -> str:
    """Prometheus text of one snapshot (tests, and anyone who wants the text without a server)."""
    reg = CollectorRegistry(auto_describe=False)

    class Once(Collector):
        def collect(self):
            return families(status, usage, excess, gpus)
    reg.register(Once())
    return generate_latest(reg).decode()


class MetricsServer:
    """prometheus_client's own HTTP server (a thread per scrape, daemon threads: it never keeps
    the process alive) on the configured address; any path serves the metrics."""

    def __init__(self, port: int, address: str = "127.0.0.1", nvml=None):
        self.collector = StatusCollector(nvml)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)
        self.httpd, self.thread = start_http_server(port, addr=address, registry=self.registry)
        self.port = self.httpd.server_address[1]

    def publish(self, status: dict, usage=(), excess=None) -> None:
        self.collector.publish(status, usage, excess)

    def close(self):
        self.httpd.shutdown()       # serve_forever returns
        self.httpd.server_close()   # the port is free again (shutdown alone keeps it bound)
        self.thread.join(timeout=5)
