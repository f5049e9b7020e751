"""The pool dashboard against the processes it reads: what tests/gateway/test_dashboards.py (sampler and
gateway, no cluster) and tests/operator/envtest/test_operator_metrics.py (all three: the operator needs an
API server) share. A panel naming a metric that nothing exports must fail one of them.

  render            `helm template` of the chart with `--set`s
  dashboard_queries every PromQL of a dashboard (panels' targets and query variables)
  metric_names      the metric names one PromQL expression reads
  exported          the series names a /metrics page declares
  sampler_and_gateway_pages  /metrics of a real fake-engine sampler and a real gateway in front of it,
                    after one request through (so labelled series exist with samples too)
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.support import REPO_ROOT
from tests.support import k8s as ks

CHART = REPO_ROOT / "charts" / "sampler-operator"
ENABLED = ["metrics.podMonitor.enabled=true", "metrics.dashboards.enabled=true"]
# What only the operator exports (sampler_operator/metrics.py): scraped where an API server runs.
OPERATOR_PREFIX = "sampler_operator_"

# PromQL words that are neither metrics nor functions (functions are followed by "(").
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or", "unless"}


def render(*sets: str) -> list[dict[str, Any]]:
    out = subprocess.run([ks.HELM, "template", "rel", str(CHART), "--namespace", "ops",
                          *[a for s in sets for a in ("--set", s)]], check=True, capture_output=True, text=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def metric_names(expr: str) -> set[str]:
    """Pure: the metric names a PromQL expression reads (label matchers, grouping labels, range
    durations, Grafana variables and function names left out)."""
    expr = re.sub(r"\$\{?\w+\}?", " ", expr)                       # $pool, $__rate_interval
    expr = re.sub(r"\{[^}]*\}", " ", expr)                          # label matchers
    expr = re.sub(r"\[[^\]]*\]", " ", expr)                         # range durations
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    expr = re.sub(r'"[^"]*"', " ", expr)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", expr):
        after = expr[m.end():].lstrip()
        if after.startswith("(") or m.group() in _KEYWORDS:
            continue
        names.add(m.group())
    return names


def dashboard_queries(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL of the dashboard: its panels' targets and its query variables (label_values(m, l): m)."""
    out = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            m = re.fullmatch(r"label_values\((.+),\s*\w+\)", var["definition"])
            assert m, var
            out.append(m.group(1))
    return out


def wanted_metrics() -> dict[str, str]:
    """Every metric the chart's dashboards read, with a query that reads it (for the failure message)."""
    [cm] = [d for d in render(*ENABLED) if d["kind"] == "ConfigMap"]
    queries = [q for text in cm["data"].values() for q in dashboard_queries(json.loads(text))]
    wanted = {name: q for q in queries for name in metric_names(q)}
    assert len(queries) >= 28 and len(wanted) >= 21, wanted  # the dashboard is read, not skipped
    return wanted


def exported(text: str) -> set[str]:
    """The series names a /metrics page declares (a family with no sample yet still declares its names:
    a counter's `_total`, a histogram's `_bucket`/`_sum`/`_count`)."""
    names = set()
    for fam in text_string_to_metric_families(text):
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"],
                    "summary": ["_sum", "_count", ""]}.get(fam.type, [""])
        names |= {fam.name + s for s in suffixes} | {s.name for s in fam.samples}
    return names


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """A /metrics page's samples: (name, labels) -> value."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def sampler_and_gateway_pages(tiny_model: Path) -> tuple[str, str]:
    """(sampler /metrics, gateway /metrics) of real processes, after one sample through the gateway."""
    from tests.support.gateway import fake_replicas, run_gateway

    with fake_replicas(tiny_model, ["r0"]) as pool, run_gateway(pool.urls()) as gw:
        gw.wait_eligible({"r0"})
        r = httpx.post(gw.url + "/v1/sample", json={"prompts": [[1, 2]], "sampling_params": {"max_tokens": 2}})
        assert r.status_code == 200, r.text
        return httpx.get(pool.servers["r0"].url + "/metrics").text, gw.metrics()
