"""Prometheus text exposition of the enforcer's state (`--metrics-port`).

The loop thread publishes a status snapshot; the HTTP thread only renders the last one, so a
scrape never touches BPF maps or enforcer state while the loop changes them."""
import http.server
import threading

GAUGES = (   # name, help, field of a container's per-GPU row (or the container's)
    ("convgpu_container_limit_bytes", "L_c: the container's GPU-memory limit", "limit"),
    ("convgpu_container_assigned_bytes", "A_c: memory assigned to the container", "assigned"),
    ("convgpu_container_used_bytes", "live device allocations of the container's processes", "used"),
    ("convgpu_container_context_overhead_bytes", "CUDA context overhead charged to the container",
     "context_overhead"),
    ("convgpu_container_stalled_seconds", "time the container has spent stalled", "stalled_s"),
)
COUNTERS = (
    ("convgpu_stalls_total", "times the container was stalled", "stalls"),
    ("convgpu_grants_total", "grants the policy gave the container", "grants"),
    ("convgpu_over_limit_total", "requests above the container's limit", "over_limit_events"),
)


def _esc(v: str) -> str:
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def render(status: dict) -> str:
    out = []
    for name, text, key in GAUGES:
        out += [f"# HELP {name} {text}", f"# TYPE {name} gauge"]
        for c in status["containers"]:
            for dev, g in c["gpus"].items():
                value = g.get(key, c.get(key))
                out.append(f'{name}{{container="{_esc(c["name"])}",id="{_esc(c["id"])}",gpu="{dev}"}} {value}')
    for name, text, key in COUNTERS:
        out += [f"# HELP {name} {text}", f"# TYPE {name} counter"]
        for c in status["containers"]:
            out.append(f'{name}{{container="{_esc(c["name"])}",id="{_esc(c["id"])}"}} {c[key]}')
    out += ["# HELP convgpu_gpu_capacity_bytes memory shared on the GPU",
            "# TYPE convgpu_gpu_capacity_bytes gauge"]
    out += [f'convgpu_gpu_capacity_bytes{{gpu="{d}"}} {g["capacity"]}' for d, g in status["gpus"].items()]
    if "unchecked_calls" in status:
        out += ["# HELP convgpu_unchecked_calls_total allocations and contexts BPF let through unchecked "
                "while the enforcer's heartbeat had lapsed", "# TYPE convgpu_unchecked_calls_total counter",
                f"convgpu_unchecked_calls_total {status['unchecked_calls']}"]
    return "\n".join(out) + "\n"


class MetricsServer:
    def __init__(self, port: int, address: str = "127.0.0.1"):
        self.status: dict = {"containers": [], "gpus": {}}
        metrics = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path.split("?")[0] not in ("/metrics", "/"):
                    self.send_error(404)
                    return
                body = render(metrics.status).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):   # one line per decision, not per scrape
                pass

        self.httpd = http.server.ThreadingHTTPServer((address, port), Handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def publish(self, status: dict) -> None:
        self.status = status   # one reference swap: the HTTP thread sees old or new, whole

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()
