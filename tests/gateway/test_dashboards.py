"""The chart's monitoring (values `metrics.*`, off by default): the PodMonitors (the pools' sampler and
gateway pods; the operator) and the Grafana dashboard ConfigMap render only when enabled, `helm lint
--strict` passes with them, and every metric the dashboard's PromQL names is exported by a real process,
scraped. A panel naming a metric nothing exports fails.

Here, without a cluster: every metric but the operator's (sampler_operator_*) against a REAL sampler
process (fake engine) and a REAL gateway in front of it, including the gateway's added latency after a
request. The operator's need an API server: tests/operator/envtest/test_operator_metrics.py runs the real
operator through a pool rollout and replacements and checks the WHOLE dashboard against all three
processes (the helpers are shared: tests/support/dashboards.py). Tested with `helm template`, as
tests/operator/unit/test_chart.py."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.support import k8s as ks
from tests.support.dashboards import (
    CHART,
    ENABLED,
    OPERATOR_PREFIX,
    exported,
    metric_names,
    render,
    sampler_and_gateway_pages,
    samples,
    wanted_metrics,
)

needs_helm = ks.needs_helm()


def test_metric_names_are_read_from_promql_without_labels_or_functions() -> None:
    expr = ('histogram_quantile(0.9, sum by (le, sampler_rl_dev_pool) (rate(sampler_weight_load_seconds_bucket'
            '{sampler_rl_dev_pool=~"$pool"}[$__rate_interval]))) - sum by (x) (up) or on(a) vector(1)')
    assert metric_names(expr) == {"sampler_weight_load_seconds_bucket", "up"}


@needs_helm
def test_monitoring_renders_only_when_enabled_and_lints_strict() -> None:
    assert not {d["kind"] for d in render()} & {"PodMonitor", "ConfigMap"}
    docs = render(*ENABLED, "metrics.podMonitor.labels.release=prom")
    monitors = {d["metadata"]["name"]: d for d in docs if d["kind"] == "PodMonitor"}
    assert sorted(monitors) == ["rel-sampler-operator-operator", "rel-sampler-operator-pools"]
    pm = monitors["rel-sampler-operator-pools"]
    assert pm["metadata"]["labels"]["release"] == "prom"
    assert pm["spec"]["namespaceSelector"] == {"any": True}
    assert pm["spec"]["podMetricsEndpoints"] == [{"port": "http", "path": "/metrics", "interval": "15s"}]
    assert pm["spec"]["selector"]["matchExpressions"][0]["values"] == ["sampler", "sampler-gateway"]
    # The operator's: its own pods, its port named "metrics", the series' namespace/pool labels kept.
    op = monitors["rel-sampler-operator-operator"]
    assert op["metadata"]["labels"]["release"] == "prom"
    assert op["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": "sampler-operator",
                                                     "app.kubernetes.io/instance": "rel"}
    assert op["spec"]["namespaceSelector"] == {"matchNames": ["ops"]}
    assert op["spec"]["podMetricsEndpoints"] == [{"port": "metrics", "path": "/metrics", "honorLabels": True,
                                                  "interval": "15s"}]
    [dep] = [d for d in docs if d["kind"] == "Deployment"]
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "metrics", "containerPort": 9090, "protocol": "TCP"} in container["ports"]
    assert {"name": "SAMPLER_OPERATOR_METRICS_PORT", "value": "9090"} in container["env"]
    [cm] = [d for d in docs if d["kind"] == "ConfigMap"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["sampler-pools.json"])["uid"] == "sampler-pools"
    narrow = {d["metadata"]["name"]: d for d in render(*ENABLED, "watch.allNamespaces=false", "watch.namespaces={a,b}")
              if d["kind"] == "PodMonitor"}
    assert narrow["rel-sampler-operator-pools"]["spec"]["namespaceSelector"] == {"matchNames": ["a", "b"]}
    # The operator's metrics off: no port, no operator PodMonitor (nothing to scrape), the pools' still.
    off = render(*ENABLED, "metrics.operatorPort=0")
    assert [d["metadata"]["name"] for d in off if d["kind"] == "PodMonitor"] == ["rel-sampler-operator-pools"]
    [dep] = [d for d in off if d["kind"] == "Deployment"]
    assert [p["name"] for p in dep["spec"]["template"]["spec"]["containers"][0]["ports"]] == ["liveness"]
    subprocess.run([ks.HELM, "lint", "--strict", str(CHART), *[a for s in ENABLED for a in ("--set", s)]],
                   check=True, capture_output=True, text=True)
    # A typo under metrics fails, as every value of the chart does (values.schema.json).
    bad = subprocess.run([ks.HELM, "template", "rel", str(CHART), "--set", "metrics.podMonitor.enabeld=true"],
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "enabeld" in bad.stderr


@needs_helm
def test_every_non_operator_dashboard_metric_is_exported_by_a_real_sampler_or_gateway(tiny_model: Path) -> None:
    wanted = wanted_metrics()
    sampler, gateway = sampler_and_gateway_pages(tiny_model)
    scraped = exported(sampler) | exported(gateway)
    missing = {name: q for name, q in wanted.items() if name not in scraped and not name.startswith(OPERATOR_PREFIX)}
    assert not missing, f"the dashboard reads metrics nothing exports: {missing}"
    assert any(name.startswith(OPERATOR_PREFIX) for name in wanted)  # covered by the envtest test
    # The request went through: the gateway timed its own share of it, less than the whole request.
    got = samples(gateway)
    count = got[("sampler_gateway_added_latency_seconds_count", frozenset())]
    added = got[("sampler_gateway_added_latency_seconds_sum", frozenset())]
    assert count == 1 and 0 < added < 10, (count, added)
