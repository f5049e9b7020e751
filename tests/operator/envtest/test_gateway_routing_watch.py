"""A gateway enforces and acknowledges a new `status.routing` when the pool's watch delivers it, not
at its next Lease renewal (sampler_gateway/routing/switch.py), against a REAL kube-apiserver.

No operator: the test writes the pool's `status.routing` itself, as the pool controller does, and
reads the gateway's Lease and /health. The gateway renews every 30 s: each step below must happen
within 10 s of the write, which only the watch can do (its renewal at startup was the last one
before them), so a gateway that waits for its renewal fails here.
"""
from __future__ import annotations

import time
import uuid
from typing import Any

import pytest

from tests.support import k8s as ks
from tests.support.gateway import run_gateway

from .test_pool_controller import G, V, pool_body, template

pytestmark = pytest.mark.envtest
RENEW_S, LEASE_S = 30, 60
WITHIN_S = 10.0   # a third of the renewal interval


def set_routing(api: Any, ns: str, generation: int, label: str, phase: str) -> None:
    api.custom.patch_namespaced_custom_object_status(G, V, ns, "samplerpools", "w", {"status": {"routing": {
        "generation": generation, "label": label, "phase": phase, "waitingFor": []}}})


def acknowledged(api: Any, ns: str) -> str | None:
    import kubernetes

    lease = kubernetes.client.CoordinationV1Api(api.client).read_namespaced_lease("gw-w-routing", ns)
    value: str | None = (lease.metadata.annotations or {}).get("sampler.rl.dev/routing-generation")
    return value


def test_a_gateway_acknowledges_a_fence_and_returns_an_opening_as_its_watch_delivers_them(
        k8s: Any, crd: Any, api: Any) -> None:
    ns = f"gw-watch-{uuid.uuid4().hex[:8]}"    # not sr-*: no operator writes this pool's status
    api.core.create_namespace({"metadata": {"name": ns}})
    try:
        pool = pool_body("w", 1, template(ks.free_port()))
        api.custom.create_namespaced_custom_object(G, V, ns, "samplerpools", pool)
        set_routing(api, ns, 1, "step-1", "Open")
        with run_gateway(None, "--pod-name", "gw-w", "--routing-renew-s", str(RENEW_S), "--routing-lease-s",
                         str(LEASE_S), pool="w", namespace=ns, env=k8s.subprocess_env()) as gw:
            # Startup: a renewal read Open(1), the next one acknowledged it; then none for 30 s.
            ks.wait_for(lambda: acknowledged(api, ns) == "1", 30, 0.05, "the startup acknowledgement")
            assert gw.health()["routing"]["generation"] == 1

            written = time.monotonic()
            set_routing(api, ns, 2, "step-2", "Fence")
            ks.wait_for(lambda: acknowledged(api, ns) == "2", WITHIN_S, 0.02, "Fence(2) acknowledged")
            health = gw.health()["routing"]
            assert (health["generation"], health["phase"], health["label"]) == (2, "Fence", "step-2")
            fence_acked = time.monotonic() - written

            written = time.monotonic()
            set_routing(api, ns, 3, "step-2", "Open")
            gw.wait(lambda h: h["routing"]["generation"] == 3 and h["routing"]["phase"] == "Open",
                    "Open(3) enforced", timeout=WITHIN_S)
            opened = time.monotonic() - written
            ks.wait_for(lambda: acknowledged(api, ns) == "3", WITHIN_S, 0.02, "Open(3) acknowledged")
            assert fence_acked < WITHIN_S and opened < WITHIN_S

            # A status written back to an older generation (by hand) moves nothing: generations only grow.
            set_routing(api, ns, 2, "step-1", "Open")
            set_routing(api, ns, 4, "step-3", "Fence")   # after the older write: once seen, the older one was too
            gw.wait(lambda h: h["routing"]["generation"] == 4, "Fence(4) enforced", timeout=WITHIN_S)
            assert gw.health()["routing"]["label"] == "step-3" and acknowledged(api, ns) in ("3", "4")
    finally:
        api.core.delete_namespace(ns)
