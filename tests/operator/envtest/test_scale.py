"""Issue #53 at a size CI affords: a SamplerPool of 32 replicas behind 4 gateways on one real API server
(tests/support/scale_pool.py: the operator process, the replicas' real sampler app on the fake engine
in one process, 4 gateway processes with kube discovery), checked for its structure, not its timings.

At steady state (the pool settled, nothing changing, no client), over a 30 s window, by each side's own
counting proxy in front of the API server:
- the operator sends nothing but its watches: no write, no read; nor for a lone SamplerReplica on its
  base model, whose `/health` reports its weights' checkpoint and load time as null (its status was
  PATCHed, unchanged, at every probe: the Operator benchmark's 2,860 requests a minute);
- the gateways write nothing but their routing Lease renewals (`update leases`), at most one per
  gateway per `--routing-renew-s` (and one more each at the window's edges), and read nothing but the
  pool at each renewal (`get samplerpools`) and their watches: nothing per replica, so nothing grows
  with N;
- the `/health` reads of each replica, counted at the replica, do not grow with G: the gateways share
  them (sampler_gateway/discovery/peers.py), each replica read about once per `--refresh-interval-s`
  whatever the number of gateways. Every gateway reading every replica would be G / interval (8 a
  second here); the bound is 1.5 / interval (one reader per interval, with room for a reader's
  fallback reads of a replica it heard nothing of).
Then a Keep push through a gateway, as a trainer pushes: Complete, every replica at the new label (its
status and its pod's own `/health`), and every gateway routing to all 32 on it; the operator wrote each
replica's spec once and its status once (the load's outcome with the look at the pod after it, issue #53:
three times before), and posted no Event per replica.
"""

from __future__ import annotations

import json
import statistics
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from sampler_gateway.config import GatewayConfig
from tests.support import k8s as ks
from tests.support.api_counts import writes
from tests.support.scale_pool import HEALTH_PERIOD_S, G, ScalePool, V, scale_pool, snapshot, window

pytestmark = pytest.mark.envtest

N, GATEWAYS = 32, 4
# A Keep push's Events, all on the pool: RolloutStarted, BatchUpdating (its replicas loading in place),
# RoutingFence, RoutingOpen and RolloutComplete; none per replica.
POOL_EVENTS = 5
WINDOW_S = 30.0
DEFAULTS = GatewayConfig(pool="p")


def lone_replica_on_its_base_model(sp: ScalePool) -> str:
    """A SamplerReplica of no pool, with no declared weights: its pod serves the base model and its
    `/health` says `weights_checkpoint: null`. Ready, then probed twice more (its status written by
    then): the window that follows sees its probes. Its pod's name."""
    from sampler_pod.testing.tiny_model import cached_tiny_model

    sp.custom.create_namespaced_custom_object(G, V, sp.ns, "samplerreplicas", {
        "apiVersion": f"{G}/{V}", "kind": "SamplerReplica", "metadata": {"name": "lone"},
        "spec": {"model": str(cached_tiny_model()), "image": "local/sampler-base:dev", "engine": "fake",
                 "port": ks.free_port(), "health": {"periodSeconds": HEALTH_PERIOD_S, "timeoutSeconds": 1}}})

    def ready() -> str | None:
        st = sp.custom.get_namespaced_custom_object(G, V, sp.ns, "samplerreplicas", "lone").get("status") or {}
        return st.get("podName") if st.get("phase") == "Ready" and (st.get("weights") or {}).get("label") == "base" \
            else None
    pod = ks.wait_for(ready, 60, 0.2, "the lone replica Ready on its base model")
    probed = snapshot(sp).health_of(pod)
    ks.wait_for(lambda: snapshot(sp).health_of(pod) >= probed + 2, 30, 0.2, "two more probes of the lone replica")
    return str(pod)


def _health(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/health", timeout=10) as r:
        body: dict[str, Any] = json.loads(r.read())
        return body


def test_at_steady_state_nothing_is_written_and_health_reads_do_not_grow_with_gateways(
        k8s: Any, crd: Any, tmp_path: Path) -> None:
    with scale_pool(k8s, N, GATEWAYS, tmp_path) as sp:
        lone_pod = lone_replica_on_its_base_model(sp)
        w = window(sp, WINDOW_S)
        figures = w.figures()
        print(f"steady state, {N} replicas, {GATEWAYS} gateways: {json.dumps(figures)}")

        # Every property is checked before any fails the test: a failure names all that do not hold.
        wrong = []
        operator = {f"{verb} {res}": n for (verb, res), n in (w.after.operator - w.before.operator).items()}
        if {k: n for k, n in operator.items() if not k.startswith("watch ")}:
            wrong.append(f"the operator sent more than its watches: {operator}")
        probes = w.after.health_of(lone_pod) - w.before.health_of(lone_pod)
        if probes < WINDOW_S / HEALTH_PERIOD_S / 2:
            wrong.append(f"the lone replica was probed {probes} times in {WINDOW_S:g} s: its writes were not tested")
        gateways = {f"{verb} {res}": n for (verb, res), n in (w.after.gateways - w.before.gateways).items()}
        others = {k: n for k, n in gateways.items()
                  if k not in ("update leases", "get samplerpools") and not k.startswith("watch ")}
        if others:
            wrong.append(f"the gateways sent more than their renewals and watches: {others}")
        renewals = GATEWAYS * (WINDOW_S / DEFAULTS.routing_renew_s + 2)
        if gateways.get("update leases", 0) > renewals:
            wrong.append(f"{gateways.get('update leases')} Lease renewals in {WINDOW_S:g} s, more than {renewals:g}")
        if gateways.get("get samplerpools", 0) > gateways.get("update leases", 0) + GATEWAYS:
            wrong.append(f"more reads of the pool than renewals: {gateways}")
        per_replica = w.health_per_s()["gateways"]
        one_reader = 1 / DEFAULTS.refresh_interval_s
        if len(per_replica) != N or statistics.mean(per_replica) > 1.5 * one_reader:
            wrong.append(f"the gateways read each replica {statistics.mean(per_replica):.2f} times a second (the "
                         f"most read {max(per_replica):.2f}); one reader per interval is {one_reader:.1f}, every "
                         f"gateway reading every replica {GATEWAYS * one_reader:.1f}")
        if min(per_replica, default=0.0) < 0.5 * one_reader:
            wrong.append(f"a replica nobody reads: {sorted(per_replica)[:3]}")
        assert not wrong, "\n".join(wrong)

        # A Keep push: every replica at the new label, every gateway routing to all of them on it.
        label = "step-2"
        before = snapshot(sp)
        sp.trainer().push(sp.checkpoint(label), label, wait=True, timeout=300, progress=False)
        ks.wait_for(lambda: sp.open_on(label), 60, 0.2, f"the pool open on {label}")
        # What the push cost the operator's writes, once each replica's loop has looked at its pod twice
        # more (a write its looks would still make after the rollout is counted): each replica's spec
        # (the pool's write) and ONE status write per replica (its load's outcome with the look after
        # it), and no Event per replica (the pool's own rollout Events only).
        pods = [p for p in sp.host.pods() if p != lone_pod]
        done = snapshot(sp)

        def looked_twice_more() -> bool:
            now = snapshot(sp)
            return all(now.health_of(p) >= done.health_of(p) + 2 for p in pods)
        ks.wait_for(looked_twice_more, 60, 0.5, "two more probes of every replica")
        pushed = writes(snapshot(sp).operator - before.operator)
        print(f"the operator's writes in a Keep push at {N} replicas: {dict(pushed)}")
        assert pushed[("patch", "samplerreplicas")] == N, pushed
        assert pushed[("patch", "samplerreplicas/status")] <= N, f"more than one status write per replica: {pushed}"
        assert pushed[("create", "events")] <= POOL_EVENTS, f"Events per replica in a Keep push: {pushed}"
        statuses = {name: (r.get("status") or {}).get("weightsLabel") for name, r in sp.replicas().items()
                    if name != "lone"}
        assert statuses == dict.fromkeys(statuses, label) and len(statuses) == N, statuses
        pods = sp.host.pods()
        pods.pop(lone_pod)
        assert len(pods) == N and {p: _health(url)["weights_label"] for p, url in pods.items()} == dict.fromkeys(
            pods, label)
        ks.wait_for(lambda: sp.gateways_see(label), 60, 0.2, f"every gateway routing to {N} at {label}")
