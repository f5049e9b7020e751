"""The chart's monitoring (values `metrics.*`, off by default): the PodMonitor and the Grafana dashboard
ConfigMap render only when enabled, `helm lint --strict` passes with them, and every metric the
dashboard's PromQL names is one that a REAL sampler process (fake engine) or a REAL gateway process in
front of it exports, scraped here. A panel naming a metric nothing exports fails.

The operator exports no Prometheus metrics (only kopf's liveness endpoint), so no panel reads one:
pool rollouts are shown by the replicas' own weight loads, replacements by the replicas' uncertain
weights (what the operator replaces). Tested with `helm template`, as tests/operator/unit/test_chart.py."""

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
from tests.support.gateway import fake_replicas, run_gateway

CHART = REPO_ROOT / "charts" / "sampler-operator"
ENABLED = ["metrics.podMonitor.enabled=true", "metrics.dashboards.enabled=true"]
needs_helm = ks.needs_helm()

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


def exported(text: str) -> set[str]:
    """The series names a /metrics page declares (a family with no sample yet still declares its names:
    a counter's `_total`, a histogram's `_bucket`/`_sum`/`_count`)."""
    names = set()
    for fam in text_string_to_metric_families(text):
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"],
                    "summary": ["_sum", "_count", ""]}.get(fam.type, [""])
        names |= {fam.name + s for s in suffixes} | {s.name for s in fam.samples}
    return names


def test_metric_names_are_read_from_promql_without_labels_or_functions() -> None:
    expr = ('histogram_quantile(0.9, sum by (le, sampler_rl_dev_pool) (rate(sampler_weight_load_seconds_bucket'
            '{sampler_rl_dev_pool=~"$pool"}[$__rate_interval]))) - sum by (x) (up) or on(a) vector(1)')
    assert metric_names(expr) == {"sampler_weight_load_seconds_bucket", "up"}


@needs_helm
def test_monitoring_renders_only_when_enabled_and_lints_strict() -> None:
    assert not {d["kind"] for d in render()} & {"PodMonitor", "ConfigMap"}
    docs = {d["kind"]: d for d in render(*ENABLED, "metrics.podMonitor.labels.release=prom")}
    pm = docs["PodMonitor"]
    assert pm["metadata"]["labels"]["release"] == "prom"
    assert pm["spec"]["namespaceSelector"] == {"any": True}
    assert pm["spec"]["podMetricsEndpoints"] == [{"port": "http", "path": "/metrics", "interval": "15s"}]
    assert pm["spec"]["selector"]["matchExpressions"][0]["values"] == ["sampler", "sampler-gateway"]
    cm = docs["ConfigMap"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["sampler-pools.json"])["uid"] == "sampler-pools"
    narrow = {d["kind"]: d for d in render(*ENABLED, "watch.allNamespaces=false", "watch.namespaces={a,b}")}
    assert narrow["PodMonitor"]["spec"]["namespaceSelector"] == {"matchNames": ["a", "b"]}
    subprocess.run([ks.HELM, "lint", "--strict", str(CHART), *[a for s in ENABLED for a in ("--set", s)]],
                   check=True, capture_output=True, text=True)
    # A typo under metrics fails, as every value of the chart does (values.schema.json).
    bad = subprocess.run([ks.HELM, "template", "rel", str(CHART), "--set", "metrics.podMonitor.enabeld=true"],
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "enabeld" in bad.stderr


@needs_helm
def test_every_dashboard_metric_is_exported_by_a_real_sampler_or_gateway(tiny_model: Path) -> None:
    [cm] = [d for d in render(*ENABLED) if d["kind"] == "ConfigMap"]
    queries = [q for text in cm["data"].values() for q in dashboard_queries(json.loads(text))]
    wanted = {name: q for q in queries for name in metric_names(q)}
    assert len(queries) >= 20 and len(wanted) >= 15, wanted  # the dashboard is read, not skipped
    with fake_replicas(tiny_model, ["r0"]) as pool, run_gateway(pool.urls()) as gw:
        gw.wait_eligible({"r0"})
        # One request through, so the labelled series exist with samples too.
        r = httpx.post(gw.url + "/v1/sample", json={"prompts": [[1, 2]], "sampling_params": {"max_tokens": 2}})
        assert r.status_code == 200, r.text
        scraped = exported(httpx.get(pool.servers["r0"].url + "/metrics").text) | exported(gw.metrics())
    missing = {name: q for name, q in wanted.items() if name not in scraped}
    assert not missing, f"the dashboard reads metrics nothing exports: {missing}"
