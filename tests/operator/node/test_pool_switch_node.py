"""Node tier, issue #24 acceptance 4: one weights order for the whole pool, on the REAL kubelet with REAL
vLLM replicas and the pool's gateway Deployment at 2 replicas.

A SamplerPool of 2 vLLM replicas with `gateway: {replicas: 2}`; closed-loop clients, each sending its
next request as soon as the last one answered, go through the gateway's address while the pool rolls
step-1 -> step-2 (Drain) -> step-3 (Keep) -> step-4 (Abort). No client ever receives an answer on
older weights than one it already received (Keep: an answer's label is its last token's), no request
fails (an Abort load's "aborted, resubmit" answers are sent again, as a trainer does, and counted
apart), every sample has all its tokens, each rollout ends RolloutComplete with every replica at its
label, and the switch protocol ran on the pods: each rollout moved `status.routing` to a newer
generation, Open at the label, and BOTH gateway pods' routing Leases acknowledge it.

How the clients reach the gateways: through the gateway's Service, as a trainer in a cluster does. Each
client sends to the Service's ClusterIP, which kube-proxy (scripts/k8s/node-up.sh, iptables mode)
rewrites to the Service's endpoints, with a new connection per request, so each request's gateway is
chosen by the Service's address, not by the client; every answer names its gateway pod
(X-Sampler-Gateway), and the test checks both served. This node has no pod network, so the gateway runs
on the node's network (`spec.gateway.hostNetwork`, as in test_pool_node.py) and its 2 replicas share the
pool's port (SO_REUSEPORT: sampler_gateway/server/listen.py): both pods are at the one address 127.0.0.1:<port>,
which the Service's EndpointSlice holds once (its controller keeps one endpoint per address, naming one
of the pods; the test checks that shape). So kube-proxy's DNAT takes each new connection to that port,
and the kernel's SO_REUSEPORT spreads the connections over the 2 gateways' sockets: the last step is the
kernel's, where on a node with a pod network it would be kube-proxy's choice between two pod IPs.
node-up.sh refuses whatever reaches the service range without kube-proxy's rewrite, so no answer comes
from the shared port by another road (test_service_node.py: a ClusterIP answering through kube-proxy).
"""
from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import kubernetes
import pytest

from sampler_operator.pool.gateway import gateway_name
from sampler_pod.testing import net
from tests.operator.node.test_node_tier import Api, _checkpoints, _vllm_replica, watched_namespace
from tests.operator.node.test_pool_node import (
    Gateway,
    _log,
    apply_pool,
    assert_clean,
    eligible_at,
    patch_pool,
    pool_api,
    pool_body,
    pool_key,
    pool_operator,
    pool_status,
    wait_pool,
    weights,
)
from tests.support import k8s as ks
from tests.support.closed_loop import older_after_newer
from tests.support.spans import by_last_token, span_problems
from tests.support.switch_clients import Clients, older_for_a_client

pytestmark = [pytest.mark.node, pytest.mark.vllm]
k8s_node = ks.node_fixture()

POOL = "sw"
GATEWAY_SELECTOR = f"sampler.rl.dev/gateway={POOL},app.kubernetes.io/name=sampler-gateway"
ACK = "sampler.rl.dev/routing-generation"   # pool/routing.py ACK_ANNOTATION
MAX_TOKENS = 32
ROLLOUTS = [(2, "Drain"), (3, "Keep"), (4, "Abort")]


# test_pool_node.py's fixtures, for this module's own cluster objects.
@pytest.fixture(scope="module")
def api(k8s_node) -> Api:
    return pool_api(k8s_node)


@pytest.fixture(scope="module")
def operator(k8s_node, api, tmp_path_factory):
    yield from pool_operator(k8s_node, tmp_path_factory)


@pytest.fixture
def ns(api, operator):
    yield from watched_namespace(api, operator)


def sample(n: int) -> dict[str, Any]:
    # ignore_eos: every sample is MAX_TOKENS long, so one cut short by a load shows.
    return {"prompts": [[1, 17, 42, 3 + n % 200]], "sampling_params": {
        "max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": n, "ignore_eos": True}}


def gateway_pods(api: Api, ns: str) -> dict[str, bool]:
    """The gateway Deployment's live pods: name -> Ready."""
    out = {}
    for p in api.core.list_namespaced_pod(ns, label_selector=GATEWAY_SELECTOR).items:
        if p.metadata.deletion_timestamp is None:
            out[p.metadata.name] = any(c.type == "Ready" and c.status == "True"
                                       for c in (p.status.conditions or []))
    return out


def acks(api: Api, ns: str) -> dict[str, int]:
    """Each gateway's routing Lease: holder (its pod) -> the routing generation it enforces."""
    leases = kubernetes.client.CoordinationV1Api(api.core.api_client).list_namespaced_lease(
        ns, label_selector=f"sampler.rl.dev/gateway={POOL}").items
    return {lease.spec.holder_identity: int((lease.metadata.annotations or {}).get(ACK, 0)) for lease in leases}


def open_at(api: Api, ns: str, label: str) -> Any:
    """The pool rolled out to `label` (every replica at it, RolloutComplete) and its routing Open at it
    with no gateway waited for: the status, else False."""
    s = pool_status(api, ns, POOL)
    r = s.get("routing") or {}
    complete = any(c.get("type") == "Progressing" and c.get("reason") == "RolloutComplete"
                   for c in s.get("conditions") or [])
    at_label = [x.get("weightsLabel") for x in s.get("replicaStatus") or []] == [label, label]
    return (r.get("phase") == "Open" and r.get("label") == label and not r.get("waitingFor") and complete
            and at_label and s.get("updatedReplicas") == 2 and s.get("readyReplicas") == 2 and s)


def wait_acknowledged(api: Api, ns: str, pods: set[str], generation: int) -> dict[str, int]:
    """Until every gateway pod's Lease says it enforces `generation` (or a later one)."""
    last: dict[str, int] = {}

    def check() -> Any:
        nonlocal last
        last = acks(api, ns)
        return set(last) >= pods and all(last[p] >= generation for p in pods) and last
    try:
        return ks.wait_for(check, 30, 0.2, f"both gateways acknowledge routing generation {generation}")
    except TimeoutError as e:
        raise TimeoutError(f"{e}; Leases: {last}") from None


def service_url(api: Api, ns: str, port: int, pods: set[str]) -> str:
    """The gateway Service's ClusterIP URL, once its EndpointSlice has a ready endpoint (kube-proxy's rules
    follow within its 1 s minimum sync period; the health reads through the URL wait for them). Both
    gateway pods are at 127.0.0.1:`port` (the node's network): the EndpointSlice controller keeps ONE
    endpoint for that address, naming one of them; the kernel's SO_REUSEPORT picks the pod."""
    svc = api.core.read_namespaced_service(gateway_name(POOL), ns)
    assert svc.spec.type == "ClusterIP" and svc.spec.cluster_ip, svc.spec
    assert [(p.port, p.target_port) for p in svc.spec.ports] == [(port, port)], svc.spec.ports
    eps = ks.wait_for(lambda: api.cluster.ready_endpoints(ns, gateway_name(POOL)), 60, 0.2,
                      "a ready endpoint of the gateway Service")
    assert len(eps) == 1 and eps[0][0] in pods and eps[0][1] == "127.0.0.1", (eps, pods)
    return f"http://{svc.spec.cluster_ip}:{port}"


@pytest.mark.timeout(1500)  # two vLLM starts and three rollouts under load, on 2 cores
def test_one_weights_order_through_two_gateway_pods_over_drain_keep_and_abort_rollouts(
        api, ns, operator, tiny_model, tmp_path):
    model = Path(tiny_model)
    root = tmp_path / "checkpoints"
    _checkpoints(model, root, 1, 2, 3, 4)
    base, port = net.free_ports(2), ks.free_port()
    template = _vllm_replica("t", base, model, root)["spec"]
    # As test_pool_node.py: vLLM's default binding would pin both engines to one core.
    template["pod"]["env"] = [{"name": "VLLM_CPU_OMP_THREADS_BIND", "value": "nobind"}]
    body = pool_body(POOL, 2, template, port, weights=weights(1))
    body["spec"]["gateway"]["replicas"] = 2
    t0 = time.monotonic()
    apply_pool(api, ns, body)
    wait_pool(api, ns, POOL, 2, "step-1", timeout=900)
    gw = Gateway(api, ns, POOL, port)
    try:
        pods = set(ks.wait_for(lambda: (g := gateway_pods(api, ns)) and len(g) == 2 and all(g.values()) and g,
                               300, 0.5, "2 gateway pods Ready"))
    except TimeoutError as e:
        raise TimeoutError(f"{e}\n{gw.diagnose()}") from None
    # Behind its Service: the clients (and the health reads below) use the ClusterIP, once the Service's
    # EndpointSlice has the gateways' address ready.
    gw.url = service_url(api, ns, port, pods)
    first = ks.wait_for(lambda: open_at(api, ns, "step-1"), 120, 0.25, "routing Open at step-1")["routing"]
    wait_acknowledged(api, ns, pods, first["generation"])
    gw.wait(lambda h: eligible_at(h, {f"{POOL}-0", f"{POOL}-1"}, "step-1"), "both replicas eligible at step-1", 300)
    _log(f"pool {POOL}: 2 vLLM replicas, gateway pods {sorted(pods)} behind {gw.url}, routing {first} "
         f"in {time.monotonic() - t0:.0f}s")
    key = pool_key(api, ns, POOL)

    order = ["step-1"]
    generations = [first["generation"]]
    clients = Clients([gw.url], key, sample, n=6, fresh_connections=True).start()
    try:
        clients.wait_for(24, "load through the gateways at step-1", timeout=300)
        for step, mode in ROLLOUTS:
            label = f"step-{step}"
            t = time.monotonic()
            patch_pool(api, ns, POOL, {"weights": weights(step), "rollout": {"mode": mode}})
            try:
                st = ks.wait_for(lambda label=label: open_at(api, ns, label), 600, 0.25,
                                 f"{mode} rollout open at {label}")
            except TimeoutError as e:
                raise TimeoutError(f"{e}; status: {json.dumps(pool_status(api, ns, POOL))[:3000]}\n"
                                   f"{gw.diagnose()}") from None
            routing = st["routing"]
            # A fence and an open at least: the switch moved the generation on, and both gateways say so.
            assert routing["generation"] >= generations[-1] + 2, (generations, routing)
            acked = wait_acknowledged(api, ns, pods, routing["generation"])
            order.append(label)
            generations.append(routing["generation"])
            _log(f"{mode} rollout to {label}: {time.monotonic() - t:.1f}s, routing {routing}, Leases {acked}")
            clients.wait_for(12, f"answers at {label}", timeout=300)
    finally:
        per_client = clients.stop()

    every = [a for answers in per_client.values() for a in answers]
    served = Counter(a.gateway for a in every)
    _log(f"{len(every)} answers, {clients.resubmitted} aborted and resubmitted; by gateway {dict(served)}; "
         f"by label { {lbl: sum(a.label == lbl for a in every) for lbl in order} }; generations {generations}")
    # 0 failed requests (aborted-and-resubmitted aside), every answer stamped, every sample whole.
    assert_clean(every, "rollouts through 2 gateway pods", gw)
    lost = [(a.replica, p) for a in every if (p := span_problems(a, order, MAX_TOKENS))]
    assert not lost, f"{len(lost)} answers not whole: {lost[:5]}"
    # 0 violations, per client, by each answer's last token (its label under Keep).
    for i, answers in per_client.items():
        labelled = by_last_token(answers, order)
        assert [a.label for a in labelled] == [a.body["weights_label"] for a in labelled], \
            f"client {i}: an answer's weights_label is not its last token's"
        assert older_for_a_client(labelled, order) == [], f"client {i} got older weights after newer"
    assert older_after_newer(by_last_token(every, order), order) == []
    assert {a.label for a in every} >= set(order[1:]), "a rollout's label never reached a client"
    # Both gateway pods served the clients, and they are the pods whose Leases acknowledged (none restarted).
    assert set(served) == pods and min(served.values()) > 0, (served, pods)
    assert set(gateway_pods(api, ns)) == pods
    opens = api.events(ns, POOL, "RoutingOpen")
    assert len(opens) >= len(order), [e.message for e in opens]
