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
as dcgm-exporter does: NVML is thread-safe and holds nothing of ours. What the families are,
and how a tenant's names are bounded as labels: enforcer/families.py."""
import logging
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client.exposition import generate_latest, make_wsgi_app
from prometheus_client.registry import Collector, CollectorRegistry

from ..threads import Thread
from .families import EMPTY, every_family, families, job_families

log = logging.getLogger(__name__)


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
        self.latest = (EMPTY, (), {}, None)   # nothing published yet: no age either

    def publish(self, status: dict, usage=(), excess=None) -> None:
        # one swap: a scrape sees old or new, whole; when, for convgpu_status_age_seconds
        self.latest = (status, tuple(usage), dict(excess or {}), time.time())

    def describe(self):
        return every_family()

    def collect(self):
        status, usage, excess, published = self.latest
        gpus = ()
        if self.nvml is not None and self.nvml.ok:
            try:
                gpus = self.nvml.gpus()
            except Exception as e:   # a driver hiccup, or NVML shut down under a late scrape
                log.debug("metrics: NVML: %s", e)
        return families(status, usage, excess, gpus, published)


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
