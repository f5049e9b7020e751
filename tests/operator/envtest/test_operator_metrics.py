"""The operator's Prometheus metrics (sampler_operator/metrics.py), scraped from the REAL operator process
against a REAL kube-apiserver, and the whole pool dashboard against all three processes it reads.

- A pool created, then rolled out to a new template: its rollouts counted (as many as the RolloutComplete
  Events the same transitions post), each timed, no stop or supersession; its pods' replacements counted
  as SpecChanged; a standalone replica whose pod reports uncertain weights: one UncertainWeights.
- Every metric the dashboard's PromQL names is exported by the operator scraped here, or by a real
  sampler (fake engine) and a real gateway in front of it (tests/support/dashboards.py, shared with
  tests/gateway/test_dashboards.py). A panel naming a metric nothing exports fails.
- An operator killed mid-rollout: the rollout is counted once, by the restarted operator, and timed from
  the status it left (from the push, not from the restart).

Pods run on the fake kubelet (harness.FakeKubelet): the metrics do not depend on what the pods serve."""
from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support import k8s as ks
from tests.support.dashboards import (
    OPERATOR_PREFIX,
    exported,
    sampler_and_gateway_pages,
    samples,
    wanted_metrics,
)
from tests.support.operator_harness import FakeKubelet, OperatorProcess, ok, uncertain

pytestmark = pytest.mark.envtest
G, V = "sampler.rl.dev", "v1alpha1"
POOL, REPLICA = "sampler.rl.dev/pool", "sampler.rl.dev/replica"  # a pool replica's pod (not its gateway's)
needs_helm = ks.needs_helm()


def template(port: int, **extra: Any) -> dict[str, Any]:
    return {"model": "/models/tiny", "image": "local/sampler-base:dev", "engine": "fake", "port": port,
            "health": {"periodSeconds": 1, "timeoutSeconds": 1, "failureThreshold": 3}, **extra}


def create_pool(api: Any, ns: str, name: str, replicas: int) -> None:
    api.custom.create_namespaced_custom_object(G, V, ns, "samplerpools", {
        "apiVersion": f"{G}/{V}", "kind": "SamplerPool", "metadata": {"name": name},
        "spec": {"replicas": replicas, "template": template(ks.free_port())}})


def new_template(api: Any, ns: str, name: str, seqs: int) -> None:
    """A template change: every replica's pod is replaced (SpecChanged), a rollout of the pool."""
    api.custom.patch_namespaced_custom_object(G, V, ns, "samplerpools", name,
                                              {"spec": {"template": {"engineArgs": {"maxNumSeqs": seqs}}}})


def pool_status(api: Any, ns: str, name: str) -> dict[str, Any]:
    return api.custom.get_namespaced_custom_object(G, V, ns, "samplerpools", name).get("status") or {}


def progressing(st: dict[str, Any]) -> str | None:
    return next((c["reason"] for c in st.get("conditions") or [] if c["type"] == "Progressing"), None)


def wait_complete(api: Any, ns: str, name: str, replicas: int, pods: set[str]) -> None:
    """The pool reports its rollout complete with exactly these pods live and Ready."""
    def done() -> bool:
        st = pool_status(api, ns, name)
        live = {p.metadata.name: p for p in api.core.list_namespaced_pod(ns, label_selector=f"{POOL}={name}").items
                if p.metadata.deletion_timestamp is None and REPLICA in (p.metadata.labels or {})}
        ready = all(any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])
                    for p in live.values())
        return (progressing(st) == "RolloutComplete" and st.get("updatedReplicas") == replicas
                and set(live) == pods and ready)
    ks.wait_for(done, 90, 0.2, f"pool {name} complete on pods {sorted(pods)}")


def value(page: str, name: str, **labels: str) -> float | None:
    return samples(page).get((name, frozenset(labels.items())))


def completes_posted(api: Any, ns: str, name: str) -> int:
    return sum(e.count or 1 for e in api.core.list_namespaced_event(ns).items
               if e.involved_object.kind == "SamplerPool" and e.involved_object.name == name
               and e.reason == "RolloutComplete")


@needs_helm
def test_rollouts_and_replacements_are_counted_and_every_dashboard_metric_is_exported(
        api: Any, ns: str, operator: OperatorProcess, tiny_model: Path) -> None:
    kubelet = FakeKubelet(api.core, ns, lambda pod, n: uncertain(2) if pod == "solo-0" else ok(1))
    try:
        started = time.time()
        create_pool(api, ns, "p", 2)
        wait_complete(api, ns, "p", 2, {"p-0-0", "p-1-0"})
        new_template(api, ns, "p", 7)
        wait_complete(api, ns, "p", 2, {"p-0-1", "p-1-1"})
        ended = time.time()
        api.custom.create_namespaced_custom_object(G, V, ns, "samplerreplicas", {
            "apiVersion": f"{G}/{V}", "kind": "SamplerReplica", "metadata": {"name": "solo"},
            "spec": {**template(ks.free_port()), "replacement": {"backoffSeconds": 0}}})
        ks.wait_for(lambda: (api.custom.get_namespaced_custom_object(G, V, ns, "samplerreplicas", "solo")
                             .get("status") or {}).get("replacements") == 1, 60, 0.2, "solo replaced once")

        def counted() -> str | None:
            page = httpx.get(operator.metrics_url, timeout=5).text
            replaced = (value(page, "sampler_operator_replica_replacements_total", namespace=ns, pool="p",
                              reason="SpecChanged"),
                        value(page, "sampler_operator_replica_replacements_total", namespace=ns, pool="default",
                              reason="UncertainWeights"))
            complete = value(page, "sampler_operator_pool_rollouts_total", namespace=ns, pool="p", outcome="complete")
            # The Events and the counter come from the same status transitions: they agree.
            return page if replaced == (2.0, 1.0) and complete == completes_posted(api, ns, "p") else None
        page = ks.wait_for(counted, 30, 0.2, "the replacements and rollouts counted")
    finally:
        kubelet.stop()
    complete = value(page, "sampler_operator_pool_rollouts_total", namespace=ns, pool="p", outcome="complete")
    assert complete is not None and complete >= 2, complete  # the pool's creation and its new template
    for outcome in ("stopped", "superseded"):  # present from the pool loop's start, at zero
        assert value(page, "sampler_operator_pool_rollouts_total", namespace=ns, pool="p", outcome=outcome) == 0
    timed = value(page, "sampler_operator_pool_rollout_duration_seconds_count", namespace=ns, pool="p")
    total = value(page, "sampler_operator_pool_rollout_duration_seconds_sum", namespace=ns, pool="p")
    assert timed == complete and total is not None
    # Timed from the status's whole seconds: none took longer than all we waited for (+ rounding).
    assert 0 <= total <= complete * (ended - started + 1), (total, ended - started)

    # The whole dashboard: every metric it reads, exported by one of the three real processes.
    wanted = wanted_metrics()
    sampler, gateway = sampler_and_gateway_pages(tiny_model)
    scraped = exported(page) | exported(sampler) | exported(gateway)
    missing = {name: q for name, q in wanted.items() if name not in scraped}
    assert not missing, f"the dashboard reads metrics nothing exports: {missing}"
    # ...and the operator's have samples of this test's pool, not only declarations.
    ours = {s[0] for s in samples(page) if ("namespace", ns) in s[1]}
    for name in (n for n in wanted if n.startswith(OPERATOR_PREFIX)):
        assert name in ours, (name, sorted(ours))


def test_a_rollout_interrupted_by_an_operator_restart_is_counted_once_and_timed_from_its_push(
        k8s: Any, crd: Any, api: Any, tmp_path: Path) -> None:
    # An operator of its own (it is killed), on a namespace the session's operator does not watch.
    ns = f"om-{uuid.uuid4().hex[:8]}"
    api.core.create_namespace({"metadata": {"name": ns}})
    release = threading.Event()
    # The new template's pod starts, but stays starting until released: the rollout is under way.
    kubelet = FakeKubelet(api.core, ns, lambda pod, n: ok(1) if pod.endswith("-0") or release.is_set()
                          else {**ok(1), "status": "starting"})
    first = OperatorProcess(k8s, [ns], tmp_path / "op.log").start()
    second = None
    try:
        first.wait_live()
        create_pool(api, ns, "q", 1)
        wait_complete(api, ns, "q", 1, {"q-0-0"})
        pushed = time.time()
        new_template(api, ns, "q", 5)
        ks.wait_for(lambda: "q-0-1" in kubelet.seen and progressing(pool_status(api, ns, "q")) == "RollingOut",
                    60, 0.2, "the new pod started, the rollout under way")
        # Well under way (the operator probed the starting pod 8 times, 1 s apart): a duration counted
        # from the restart instead of from the push would come out seconds short.
        ks.wait_for(lambda: kubelet.probes("q-0-1") >= 8, 60, 0.2, "8 probes of the starting pod")
        before = httpx.get(first.metrics_url, timeout=5).text
        assert value(before, "sampler_operator_pool_rollouts_total", namespace=ns, pool="q", outcome="complete") == 1
        first.kill()
        killed = time.time()
        second = OperatorProcess(k8s, [ns], tmp_path / "op.log").start()
        second.wait_live()
        release.set()
        wait_complete(api, ns, "q", 1, {"q-0-1"})

        def counted() -> str | None:
            page = httpx.get(second.metrics_url, timeout=5).text
            n = value(page, "sampler_operator_pool_rollouts_total", namespace=ns, pool="q", outcome="complete")
            return page if n == 1 else None
        page = ks.wait_for(counted, 30, 0.2, "the restarted operator counted the rollout")
        done = time.time()
    finally:
        kubelet.stop()
        if second is not None:
            second.stop()
        first.stop()
        api.core.delete_namespace(ns)
    # Once (the first operator never saw it end), timed from the push the status recorded: longer than
    # the part before the kill, within the whole (the status's times are whole seconds).
    assert value(page, "sampler_operator_pool_rollout_duration_seconds_count", namespace=ns, pool="q") == 1
    seconds = value(page, "sampler_operator_pool_rollout_duration_seconds_sum", namespace=ns, pool="q")
    assert seconds is not None and killed - pushed - 2 <= seconds <= done - pushed + 1, (
        seconds, killed - pushed, done - pushed)
