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
import socket
import ssl
import threading
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client.exposition import generate_latest, make_wsgi_app
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from ..probes.nvml import GpuInfo
from ..threads import Thread

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
    ("convgpu_container_over_limit_bytes", "how far the driver's count (NVML) of the container's processes is "
     "above its limit (0: within it)", "over_by"),
    ("convgpu_container_over_limit_seconds", "how long the driver's count has been above its limit", "over_s"),
)
COUNTERS = (   # per container; the family's name gets `_total` on the wire
    ("convgpu_stalls", "times the container was stalled", "stalls"),
    ("convgpu_grants", "grants the policy gave the container", "grants"),
    ("convgpu_over_limit", "requests above the container's limit", "over_limit_events"),
)


def families(status: dict, usage=(), excess=None, gpus=()) -> list:
    """The metric families of one snapshot. status: Reporter.status() (Enforcer.status()); usage: the probes' rows
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
        est = status["gpus"].get(dev, {}).get("ctx_estimate", {}).get("bytes", 0)   # the device's charge per context
        ctx.add_metric(lab, max(u.contexts, 0) * est + excess.get((u.pid, u.dev), 0))
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


def job_families(recs) -> list:
    """Each job's recent peak and recommended limit (enforcer/history/recommend.py): recs is the
    recorder's summary. A job's label is its key, percent-encoded by enforcer/history/jobs.py
    and escaped again by the library; at most MAX_JOBS (256) jobs, so at most as many series."""
    peak = GaugeMetricFamily("convgpu_job_peak_bytes", "the most the job held on the GPU in its recent runs "
                             "(allocations and context charge)", labels=("job", "gpu"))
    rec = GaugeMetricFamily("convgpu_job_recommended_limit_bytes", "the limit `convgpu recommend` gives the job "
                            "(docs/RECOMMEND.md)", labels=("job",))
    asked = GaugeMetricFamily("convgpu_job_asked_bytes", "the limit of the job's newest run", labels=("job",))
    flag = GaugeMetricFamily("convgpu_job_misasked", "1 where the job asks over twice what it needs (way=over) "
                             "or was held at its limit (way=under)", labels=("job", "way"))
    for r in recs:
        for gpu, n in r.peaks.items():
            peak.add_metric([r.job, str(gpu)], n)
        rec.add_metric([r.job], r.limit)
        if r.asked is not None:
            asked.add_metric([r.job], r.asked)
        flag.add_metric([r.job, "over"], int(r.over_asking))
        flag.add_metric([r.job, "under"], int(r.under_asking))
    return [peak, rec, asked, flag]


class JobCollector(Collector):
    """The job history's families (the recorder's summary, swapped whole after each write)."""

    def __init__(self, recorder):
        self.recorder = recorder

    def describe(self):
        return job_families(())

    def collect(self):
        return job_families(self.recorder.summary)


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


@dataclass(frozen=True)
class Tls:
    """HTTPS for the scrape, and with `client_ca` mutual TLS: only a client whose certificate
    that CA signed (the cluster's Prometheus) reads the metrics (docs/SECURITY.md row 11)."""
    cert: str
    key: str
    client_ca: str | None = None

    def context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=self.client_ca)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.cert, self.key)
        ctx.verify_mode = ssl.CERT_REQUIRED if self.client_ca else ssl.CERT_NONE
        return ctx


class _Quiet(WSGIRequestHandler):
    def log_message(self, *args):   # one line per scrape on stderr is noise
        pass


class _BoundedServer(ThreadingMixIn, WSGIServer):
    """prometheus_client's WSGI app behind a server that a scraper cannot exhaust: at most
    `slots` connections at once (more are closed at accept), each with a socket timeout, and
    the TLS handshake in the connection's thread under that timeout. prometheus_client's own
    start_http_server starts a thread per connection with no timeout and, with TLS, makes the
    handshake inside accept(): one client that connects and sends nothing stops every scrape."""
    daemon_threads = True
    block_on_close = False
    slots: threading.BoundedSemaphore
    io_timeout = 10.0
    tls: ssl.SSLContext | None = None

    def get_request(self):
        conn, addr = self.socket.accept()
        conn.settimeout(self.io_timeout)
        return conn, addr

    def verify_request(self, request, client_address) -> bool:
        return self.slots.acquire(blocking=False)

    def process_request_thread(self, request, client_address):
        try:
            if self.tls is not None:
                request = self.tls.wrap_socket(request, server_side=True)
            self.finish_request(request, client_address)
        except (OSError, ssl.SSLError) as e:   # a client gone, slow, or without a certificate
            log.debug("metrics: %s: %s", client_address, e)
        finally:
            self.shutdown_request(request)
            self.slots.release()


class MetricsServer:
    """The metrics over HTTP(S) on the configured address (a thread of its own, daemon: it never
    keeps the process alive); any path serves the metrics."""

    def __init__(self, port: int, address: str = "127.0.0.1", nvml=None, tls: Tls | None = None,
                 max_connections: int = 8, timeout: float = 10.0, extra=()):
        self.collector = StatusCollector(nvml)
        self.registry = CollectorRegistry(auto_describe=False)
        for c in (self.collector, *extra):   # extra: JobCollector
            self.registry.register(c)
        server = type("MetricsHTTPServer", (_BoundedServer,), {
            "address_family": socket.AF_INET6 if ":" in address else socket.AF_INET,
            "slots": threading.BoundedSemaphore(max_connections), "io_timeout": timeout,
            "tls": tls.context() if tls else None})
        self.httpd = make_server(address, port, make_wsgi_app(self.registry), server, handler_class=_Quiet)
        self.thread = Thread(target=self.httpd.serve_forever, name="convgpu-metrics", daemon=True)
        self.thread.start()
        self.port = self.httpd.server_address[1]

    def publish(self, status: dict, usage=(), excess=None) -> None:
        self.collector.publish(status, usage, excess)

    def close(self):
        self.httpd.shutdown()       # serve_forever returns
        self.httpd.server_close()   # the port is free again (shutdown alone keeps it bound)
        self.thread.join(timeout=5)
