"""A real Prometheus for the tests (Debian's `prometheus`, installed by scripts/setup.sh): on
loopback only, its data in a temporary folder, scraping and evaluating rules every second; and
the dashboard's queries as Grafana would send them."""
import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "deploy" / "prometheus" / "convgpu-rules.yaml"
DASHBOARD = ROOT / "deploy" / "grafana" / "convgpu.json"
# The rules as shipped, made quick for a test: every `for:` 0 s, and the thresholds that are
# durations cut to seconds (each must occur exactly once in its alert's expression, so that an
# edit of the rule that this copy would miss fails here instead)
QUICK = {"ConvgpuContainerHeldLong": ("> 1800", "> 2")}
# What Grafana puts for the dashboard's variables: every node and GPU (the "All" value); a
# rate's window four scrapes wide at least, as Grafana's $__rate_interval is
GRAFANA_VARS = {"$instance": ".*", "$gpu": ".*", "$__rate_interval": "15s"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def quick_rules() -> str:
    doc = yaml.safe_load(RULES.read_text())
    for g in doc["groups"]:
        for r in g["rules"]:
            if "alert" not in r:
                continue
            r.pop("for", None)
            if r["alert"] in QUICK:
                old, new = QUICK[r["alert"]]
                assert r["expr"].count(old) == 1, (r["alert"], r["expr"], old)
                r["expr"] = r["expr"].replace(old, new)
    return yaml.safe_dump(doc)


def dashboard_targets() -> list[tuple[dict, dict, str]]:
    """(panel, target, expression with Grafana's variables filled in) for every query of the
    dashboard (rows have none)."""
    out = []
    for p in json.loads(DASHBOARD.read_text())["panels"]:
        for t in p.get("targets", ()):
            expr = t["expr"]
            for var, value in GRAFANA_VARS.items():
                expr = expr.replace(var, value)
            assert "$" not in expr, (p["title"], expr)
            out.append((p, t, expr))
    return out


class Prometheus:
    """`prometheus` scraping `targets` (host:port) as job `convgpu` with the rules in
    `rules_text`, every second; stopped by close()."""

    def __init__(self, workdir: Path, targets: list[str], rules_text: str):
        binary = shutil.which("prometheus")
        assert binary, "prometheus not installed (scripts/setup.sh installs Debian's prometheus)"
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "rules.yaml").write_text(rules_text)
        (workdir / "prometheus.yml").write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "900ms"},
            "rule_files": ["rules.yaml"],
            "scrape_configs": [{"job_name": "convgpu", "static_configs": [{"targets": targets}]}]}))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(workdir / "prometheus.log", "w+")
        self.p = subprocess.Popen([binary, f"--config.file={workdir / 'prometheus.yml'}",
                                   f"--storage.tsdb.path={workdir / 'data'}",
                                   f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                                  stdout=self.log, stderr=subprocess.STDOUT, cwd=workdir)
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if self.p.poll() is not None or time.monotonic() > deadline:
                self.log.seek(0)
                raise AssertionError(f"prometheus did not start: {self.log.read()[-2000:]}")
            time.sleep(0.1)
        self.started = time.time()

    def api(self, path: str, **params):
        url = f"{self.url}/api/v1/{path}" + ("?" + urllib.parse.urlencode(params) if params else "")
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        return self.api("query", query=expr)["result"]

    def values(self, expr: str) -> dict:
        """{the series' labels (without __name__, job, instance), as a sorted tuple: value}."""
        return {tuple(sorted((k, v) for k, v in r["metric"].items() if k not in ("__name__", "job", "instance"))):
                float(r["value"][1]) for r in self.query(expr)}

    def query_range(self, expr: str, start: float, end: float, step: float = 1.0) -> list[dict]:
        return self.api("query_range", query=expr, start=start, end=end, step=step)["result"]

    def alerts(self, state: str = "firing") -> set[tuple]:
        """(alert name, the container, GPU or instance it is about) of the alerts in `state`."""
        return {(a["labels"]["alertname"], a["labels"].get("container") or a["labels"].get("gpu")
                 or a["labels"].get("instance", "")) for a in self.api("alerts")["alerts"] if a["state"] == state}

    def until(self, cond, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while True:
            got = cond()
            if got:
                return got
            if time.monotonic() > deadline:
                scrapes = [(t["scrapeUrl"], t["health"], t["lastError"]) for t in self.api("targets")["activeTargets"]]
                raise AssertionError(f"{what}: Prometheus's alerts {self.api('alerts')['alerts']}, scrapes {scrapes}")
            time.sleep(0.2)

    def close(self):
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self.log.close()
