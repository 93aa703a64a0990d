"""Writes deploy/kubernetes/monitoring/prometheusrule.yaml, the Prometheus Operator's
PrometheusRule, from deploy/prometheus/convgpu-rules.yaml (the one copy of the rules, which
promtool tests): `.venv/bin/python scripts/prometheusrule.py` after changing the rules.
tests/unit/test_prometheus_rules.py fails when the two differ."""
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "deploy" / "prometheus" / "convgpu-rules.yaml"
OUT = ROOT / "deploy" / "kubernetes" / "monitoring" / "prometheusrule.yaml"
HEADER = """\
# Made by scripts/prometheusrule.py from deploy/prometheus/convgpu-rules.yaml: change that file
# and run the script (tests/unit/test_prometheus_rules.py fails when the two differ). Your
# Prometheus's ruleSelector must match a label here (kube-prometheus-stack: add
# `release: <its release>` in an overlay); runbooks: docs/OPERATOR.md, "Runbook".
"""


def text() -> str:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    doc = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
           "metadata": {"name": "convgpu", "namespace": "convgpu", "labels": {"app.kubernetes.io/name": "convgpu"}},
           "spec": {"groups": groups}}
    return HEADER + yaml.safe_dump(doc, sort_keys=False, width=1000)


if __name__ == "__main__":
    if sys.argv[1:] == ["--check"]:
        sys.exit(0 if OUT.read_text() == text() else f"{OUT} differs from {RULES}: run {sys.argv[0]}")
    OUT.write_text(text())
