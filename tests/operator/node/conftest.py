"""The node tier's one rule for all its modules: a test whose pods run the real vLLM engine carries the
`vllm` mark. scripts/test.sh runs the unmarked tests beside the engine tier, and two chains running
vLLM at once on 2 cores turn timing margins into failures. So an unmarked test that made a vLLM
SamplerReplica fails here, naming the mark, instead of slowing another tier by surprise."""

from __future__ import annotations

import datetime as dt
from collections.abc import Generator
from typing import Any

import pytest

from tests.support.k8s import CommandError


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, Any, Any]:
    started = dt.datetime.now(dt.UTC).replace(microsecond=0)
    result = yield  # a failing test raises here: its own failure is the one reported
    cluster = getattr(item, "funcargs", {}).get("k8s_node")
    if item.get_closest_marker("vllm") is None and cluster is not None:
        made = _vllm_replicas_since(cluster, started)
        assert not made, (f"{item.nodeid} made vLLM SamplerReplicas ({', '.join(made)}) but is not marked "
                          "@pytest.mark.vllm (tests/operator/node/conftest.py)")
    return result


def _vllm_replicas_since(cluster: Any, started: dt.datetime) -> list[str]:
    try:
        items = cluster.kubectl_json("get", "samplerreplicas.sampler.rl.dev", "--all-namespaces")["items"]
    except CommandError:  # no CRD installed by this test: it made no replica at all
        return []
    return [f"{o['metadata']['namespace']}/{o['metadata']['name']}" for o in items
            if (o.get("spec") or {}).get("engine") == "vllm"
            and dt.datetime.fromisoformat(o["metadata"]["creationTimestamp"].replace("Z", "+00:00")) >= started]
