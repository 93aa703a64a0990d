"""The alert and recording rules (deploy/prometheus/convgpu-rules.yaml) under Prometheus's own
promtool: `check rules`, and `test rules` with series that fire and series that stay quiet
(tests/unit/prometheus/convgpu-rules.test.yaml). An alert whose expression is broken, so that it
never fires or fires on anything, fails them; every alert's runbook is in docs/OPERATOR.md; the
PrometheusRule is made from the same file; and the exposition passes `promtool check metrics`
(Prometheus's naming conventions: units in names, `_total` on counters)."""
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import need

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "convgpu-rules.yaml"
TESTS = ROOT / "tests" / "unit" / "prometheus" / "convgpu-rules.test.yaml"


@pytest.fixture(scope="module")
def promtool():
    tool = shutil.which("promtool")
    need(tool is not None, "promtool not installed (scripts/setup.sh installs Debian's prometheus)")
    return tool


def run(*args) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=120)


def alerts(groups) -> list[dict]:
    return [r for g in groups for r in g["rules"] if "alert" in r]


def test_the_rules_pass_promtools_check_and_unit_tests(promtool):
    r = run(promtool, "check", "rules", str(RULES))
    assert r.returncode == 0 and "SUCCESS: 17 rules found" in r.stdout, r.stdout + r.stderr
    r = run(promtool, "test", "rules", str(TESTS))
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr
    # every alert is tested (a rule nobody tests could be broken unseen)
    tested = set(re.findall(r"alertname: (\w+)", TESTS.read_text()))
    assert tested == {a["alert"] for a in alerts(yaml.safe_load(RULES.read_text())["groups"])}


def test_an_alert_with_a_broken_expression_fails_the_unit_tests(promtool, tmp_path):
    """Each alert in turn made to never fire (its firing case fails) or to fire on anything
    (its quiet case, or its labels, fail): promtool's tests catch every one. One promtool run
    takes every broken copy (a test file, with the cases that name the alert, and its rules in
    a folder of their own)."""
    names = [a["alert"] for a in alerts(yaml.safe_load(RULES.read_text())["groups"])]
    files = {}
    for name in names:
        test = yaml.safe_load(TESTS.read_text())
        test["rule_files"] = ["rules.yaml"]
        test["tests"] = [t for t in test["tests"] if any(a["alertname"] == name for a in t.get("alert_rule_test", ()))]
        for broken, expr in (("never", "vector(1) > 2"), ("always", "vector(1)")):
            doc = yaml.safe_load(RULES.read_text())
            [rule] = [a for a in alerts(doc["groups"]) if a["alert"] == name]
            rule["expr"] = expr
            d = tmp_path / f"{name}-{broken}"
            d.mkdir()
            (d / "rules.yaml").write_text(yaml.safe_dump(doc))
            (d / "test.yaml").write_text(yaml.safe_dump(test))
            files[str(d / "test.yaml")] = name
    r = subprocess.run([promtool, "test", "rules", *files], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=120)
    assert r.returncode != 0
    out = r.stdout
    sections = dict(re.findall(r"Unit Testing:\s+(\S+)\n(.*?)(?=Unit Testing:|\Z)", out, re.S))
    assert set(sections) == set(files), out[:2000]
    for path, name in files.items():
        assert "FAILED" in sections[path] and f"alertname: {name}," in sections[path], (path, sections[path])


def test_every_alert_has_a_runbook_in_the_operator_guide():
    guide = (ROOT / "docs" / "OPERATOR.md").read_text()
    runbook = guide[guide.index("\n### Runbook"):]
    headings = set(re.findall(r"^#### (\w+)$", runbook, re.M))
    for a in alerts(yaml.safe_load(RULES.read_text())["groups"]):
        name = a["alert"]
        assert a["annotations"]["runbook_url"] == f"docs/OPERATOR.md#{name.lower()}", name
        assert name in headings, f"docs/OPERATOR.md has no runbook heading #### {name}"
        text = runbook.split(f"#### {name}\n", 1)[1].split("\n#### ", 1)[0]
        assert all(w in text for w in ("**Means**", "**Look at**", "**Do**")), name
        assert a["labels"]["severity"] in ("critical", "warning", "info"), name


def test_the_prometheusrule_is_made_from_the_rules_file():
    r = run(sys.executable, str(ROOT / "scripts" / "prometheusrule.py"), "--check")
    assert r.returncode == 0, r.stderr
    pr = yaml.safe_load((ROOT / "deploy" / "kubernetes" / "monitoring" / "prometheusrule.yaml").read_text())
    assert pr["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]


FULL = {"started": 1.7e9, "policy": "bf", "stall": "signal", "over_limit": "stall", "unchecked_calls": 2,
        "probes": {"attached": 1, "failed": 0}, "unprobed": [{"pid": 9, "library": "/x", "reason": "r", "action": "allow"}],
        "gpus": {"0": {"capacity": 4 << 30, "assigned": 1 << 30, "committed": 1 << 30, "unattributed": 0,
                       "tearing_down": 0, "backstop": "on", "ctx_estimate": {"bytes": 0}}},
        "containers": [{"name": "a", "id": "b", "pids": [7], "stalled_s": 1.0, "stalls": 1, "grants": 1,
                        "over_limit_events": 0,
                        "gpus": {"0": {"limit": 1 << 30, "assigned": 1 << 30, "used": 5, "context_overhead": 0,
                                       "waiting": True, "waiting_s": 2.0, "waiting_pids": [7], "over_by": 0,
                                       "over_s": 0.0, "swapped": 0}}}]}


def test_the_exposition_follows_prometheus_naming_conventions(promtool):
    """Every family the enforcer exports, each with samples, linted by `promtool check
    metrics`: it flags a counter without `_total`, a unit that is not the base one
    (`_milliseconds`), a metric without help."""
    from convgpu.enforcer.families import every_family, families, job_families
    from convgpu.enforcer.history.recommend import Recommendation
    from convgpu.probes.nvml import GpuInfo
    from convgpu.probes.tracer import ProcUsage
    from prometheus_client.exposition import generate_latest
    from prometheus_client.registry import Collector, CollectorRegistry

    use = ProcUsage(pid=7, dev=0, gen=1, cgroup_id=1, comm="x", live=5, peak=5, n_alloc=1, n_free=0, bytes_alloc=5,
                    bytes_free=0, n_failed=0, contexts=1, last_ns=0)
    fams = families(FULL, [use], {}, [GpuInfo(0, "H100", 80 << 30, 1 << 30, "GPU-1")], published=1.7e9)
    assert {f.name for f in fams} == {f.name for f in every_family()}   # describe() names them all
    assert all(f.samples for f in fams), [f.name for f in fams if not f.samples]
    fams += job_families([Recommendation("run:train", 3, 5, {0: 5}, 6, 3, 8, "run", 1, 1, 0, 0.0, 0.0, 0, True,
                                         False, ())])

    class All(Collector):
        def collect(self):
            return fams
    reg = CollectorRegistry(auto_describe=False)
    reg.register(All())
    text = generate_latest(reg).decode()
    r = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and not r.stdout.strip() and not r.stderr.strip(), r.stdout + r.stderr


def exported_names() -> set[str]:
    """Every sample name the enforcer can put on the wire (counters with `_total`, info with `_info`)."""
    from convgpu.enforcer.families import every_family, job_families
    return {s.name for f in every_family() + job_families(()) for s in f.samples} | {
        f.name + {"counter": "_total", "info": "_info"}.get(f.type, "") for f in every_family() + job_families(())}


def test_the_rules_and_the_dashboard_name_only_metrics_the_enforcer_exports():
    """A misspelt metric in a rule or a panel returns nothing, silently, for ever: each name they
    use is one the enforcer exports (or a recording rule of the file). The panels fit Grafana's
    24 columns without overlapping, each has a query and a unit."""
    rules = yaml.safe_load(RULES.read_text())["groups"]
    recorded = {r["record"] for g in rules for r in g["rules"] if "record" in r}
    dash = json.loads((ROOT / "deploy" / "grafana" / "convgpu.json").read_text())
    exprs = [r["expr"] for g in rules for r in g["rules"]] + [t["expr"] for p in dash["panels"] for t in p.get("targets", ())]
    used = {n for e in exprs for n in re.findall(r"\b(?:instance_gpu:|instance:)?convgpu_[a-z_]+(?::[a-z0-9]+)?", e)}
    assert used - exported_names() - recorded == set()
    assert len(used & recorded) >= 1 and len(used) >= 20
    cells = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, f"{p['title']} overlaps another panel"
        cells |= mine
        if p["type"] != "row":
            assert p["targets"] and "unit" in p["fieldConfig"]["defaults"], p["title"]
