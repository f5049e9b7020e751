"""A SamplerPool driven through its `/scale` subresource, as an HPA or KEDA drives one (not `kubectl
scale`, which test_pool_controller.py uses): a REAL kube-apiserver and the operator as a subprocess.
The scale's `status.selector` (labelSelectorPath) selects exactly the pool's sampler pods, which is how
an HPA finds the pods whose metrics it reads."""
from __future__ import annotations

from typing import Any

import pytest

from tests.support import k8s as ks
from tests.support.operator_harness import FakeKubelet, ok

from .test_pool_controller import G, V, pool_body, pool_status, replicas_of, template

pytestmark = pytest.mark.envtest


def test_the_scale_subresource_scales_the_pool_and_selects_its_pods(api: Any, ns: str, operator: Any) -> None:
    kubelet = FakeKubelet(api.core, ns, lambda pod, n: ok(1))
    try:
        body = pool_body("s", 1, template(ks.free_port()))
        api.custom.create_namespaced_custom_object(G, V, ns, "samplerpools", body)
        ks.wait_for(lambda: pool_status(api, ns, "s").get("readyReplicas") == 1, 60, 0.2, "1 Ready")
        # What an HPA writes: spec.replicas of the scale subresource, nothing else of the pool.
        api.custom.patch_namespaced_custom_object_scale(G, V, ns, "samplerpools", "s", {"spec": {"replicas": 3}})
        ks.wait_for(lambda: sorted(replicas_of(api, ns)) == ["s-0", "s-1", "s-2"], 60, 0.1, "scaled to 3")
        ks.wait_for(lambda: pool_status(api, ns, "s").get("readyReplicas") == 3, 60, 0.2, "3 Ready")
        scale = api.custom.get_namespaced_custom_object_scale(G, V, ns, "samplerpools", "s")
        assert scale["spec"]["replicas"] == 3 and scale["status"]["replicas"] == 3, scale
        selector = scale["status"]["selector"]
        assert selector == "sampler.rl.dev/pool=s", scale
        # The selector names the pool's sampler pods and nothing else (not the gateway's, not another pool's).
        pods = {p.metadata.name for p in api.core.list_namespaced_pod(ns, label_selector=selector).items}
        assert pods == {o["status"]["podName"] for o in replicas_of(api, ns).values()} and len(pods) == 3, pods
        api.custom.patch_namespaced_custom_object_scale(G, V, ns, "samplerpools", "s", {"spec": {"replicas": 1}})
        ks.wait_for(lambda: sorted(replicas_of(api, ns)) == ["s-0"], 60, 0.1, "scaled back to 1")
        ks.wait_for(lambda: api.custom.get_namespaced_custom_object_scale(
            G, V, ns, "samplerpools", "s")["status"]["replicas"] == 1, 30, 0.2, "the scale's status at 1")
    finally:
        kubelet.stop()
