"""Node tier, issue #12 acceptance 2-4: a SamplerPool on the REAL kubelet. Its replicas AND its gateway
(the Deployment the operator writes, on the operator's image) are real pods; a closed-loop client
(tests/support/closed_loop.py) samples through the gateway while the pool changes under it.

- Rollout under load (REAL vLLM, pool of 2, maxUnavailable 1, Latest, concurrency 16): step-1 ->
  step-2 -> step-3 with 0 failed requests, every sequence stamped, never an older version after a
  newer one, UPDATED = 2 each time, and greedy prompt logprobs at step-3's reference at the end.
- Keep (same pool and pods, issue #22 acceptance 4, step-3 -> step-4): every replica loads in place,
  nothing lost, samples in flight continue onto the new weights.
- Replacement safety (same pool, Drain again, step-4 -> step-5): the replica not yet updated has a
  weight write fail midway (the sampler's test seam); its replacement pod admits no request before it
  reports step-5 (its own admitted counter, read before its /health), and the pool ends at 2/2 on step-5.
  The three rollouts share one pool: its vLLM starts are most of their time.
- Drain (fake engine, 3 -> 2 under load): no request lost; no request sent more than a second after
  the leaving replica was marked draining reaches it (the gateway names the replica of each answer).

Replicas use hostNetwork (the node has no pod network): a pool gives replica i `template.port + i`.
The gateway runs with `spec.gateway.hostNetwork`, the API server's address in `spec.gateway.env` (the
`kubernetes` Service has no endpoints here: the API server listens on 127.0.0.1, which no Endpoints may
hold) and its account's token mounted through `spec.gateway.volumes` (this API server injects none):
documented pool options, nothing test-only.
"""
from __future__ import annotations

import base64
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import pytest

from sampler_pod.testing import net
from tests.operator.node.test_node_tier import (
    PROMPT,
    Api,
    _checkpoints,
    _close,
    _vllm_replica,
    assert_restricted,
    operator_for_module,
    post,
    project_image,
    replica,
    watched_namespace,
)
from tests.support import REPO_ROOT
from tests.support import k8s as ks
from tests.support.closed_loop import Answer, ClosedLoop, older_after_newer
from tests.support.metrics import total
from tests.support.operator_harness import OperatorProcess
from tests.support.polling import Poller

pytestmark = pytest.mark.node
k8s_node = ks.node_fixture()

G, V = "sampler.rl.dev", "v1alpha1"
DRAINING = "sampler.rl.dev/draining"
# In-cluster config reads these; the `kubernetes` Service has no endpoints on this node (see above).
API_SERVER_ENV = [{"name": "KUBERNETES_SERVICE_HOST", "value": "127.0.0.1"},
                  {"name": "KUBERNETES_SERVICE_PORT", "value": "6443"}]


def _log(msg: str) -> None:
    print(f"[pool-node {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------------------------------ fixtures
def pool_api(k8s_node: ks.Cluster) -> Api:
    """The API with both CRDs established (other node modules with pools share it)."""
    a = Api(k8s_node)
    for crd, name in (("samplerreplica.yaml", "samplerreplicas"), ("samplerpool.yaml", "samplerpools")):
        k8s_node.kubectl("apply", "-f", str(REPO_ROOT / "crds" / crd))
        ks.wait_crd_established(f"{name}.sampler.rl.dev", cluster=k8s_node)
    return a


def pool_operator(k8s_node: ks.Cluster, tmp_path_factory: Any) -> Iterator[OperatorProcess]:
    """As test_node_tier.py's; pools' gateways run the operator IMAGE, as the chart configures it."""
    yield from operator_for_module(k8s_node, tmp_path_factory,
                                   {"SAMPLER_OPERATOR_GATEWAY_IMAGE": project_image("operator").tag})


@pytest.fixture(scope="module")
def api(k8s_node) -> Api:
    return pool_api(k8s_node)


@pytest.fixture(scope="module")
def operator(k8s_node, api, tmp_path_factory):
    yield from pool_operator(k8s_node, tmp_path_factory)


@pytest.fixture
def ns(api, operator):
    yield from watched_namespace(api, operator)


# ------------------------------------------------------------------------------------------ helpers
def weights(step: int) -> dict[str, str]:
    """The pool's weights: step-N of the checkpoints the replicas mount at /checkpoints."""
    return {"checkpoint": f"/checkpoints/step-{step}", "versionLabel": f"step-{step}"}


def pool_body(name: str, replicas: int, template: dict[str, Any], gateway_port: int,
              **spec: Any) -> dict[str, Any]:
    # This API server injects no service-account token (no ServiceAccount admission plugin): the
    # gateway mounts its account's token Secret (apply_pool makes it) where in-cluster config reads it.
    token = {"name": "sa-token", "secret": {"secretName": f"{name}-gateway-token"}}
    mount = {"name": "sa-token", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount", "readOnly": True}
    return {"apiVersion": f"{G}/{V}", "kind": "SamplerPool", "metadata": {"name": name},
            "spec": {"replicas": replicas, "template": template,
                     "rollout": {"maxUnavailable": 1}, "routing": {"versionPolicy": "Latest"},
                     "gateway": {"port": gateway_port, "hostNetwork": True, "env": API_SERVER_ENV,
                                 "volumes": [token], "volumeMounts": [mount]}, **spec}}


def apply_pool(api: Api, ns: str, body: dict[str, Any]) -> None:
    """The pool, then a token Secret for its gateway's ServiceAccount once the operator made it (the
    controller-manager fills it in; the kubelet retries the gateway pod's mount until then)."""
    api.apply(ns, body)
    name = body["metadata"]["name"]
    account = f"{name}-gateway"
    ks.wait_for(lambda: any(a.metadata.name == account for a in api.core.list_namespaced_service_account(ns).items),
                60, 0.2, f"ServiceAccount {account}")
    api.core.create_namespaced_secret(ns, {
        "metadata": {"name": f"{name}-gateway-token", "annotations": {"kubernetes.io/service-account.name": account}},
        "type": "kubernetes.io/service-account-token"})


def pool_status(api: Api, ns: str, name: str) -> dict[str, Any]:
    return api.custom.get_namespaced_custom_object(G, V, ns, "samplerpools", name).get("status") or {}


def wait_pool(api: Api, ns: str, name: str, n: int, label: str | None, timeout: float) -> dict[str, Any]:
    """Until the pool reports n replicas ready and updated (at `label`)."""
    last: dict[str, Any] = {}

    def check() -> Any:
        nonlocal last
        last = pool_status(api, ns, name)
        return (last.get("readyReplicas") == n and last.get("updatedReplicas") == n and last.get("replicas") == n
                and last.get("targetLabel") == label and last)
    try:
        return ks.wait_for(check, timeout, 0.5, f"pool {name}: {n}/{n} at {label}")
    except TimeoutError as e:
        raise TimeoutError(f"{e}; last status: {json.dumps(last)[:3000]}") from None


def pool_key(api: Api, ns: str, pool: str, key: str = "api-key") -> str:
    return base64.b64decode(api.core.read_namespaced_secret(f"{pool}-sampler-keys", ns).data[key]).decode()


def patch_pool(api: Api, ns: str, name: str, spec: dict[str, Any]) -> None:
    api.custom.patch_namespaced_custom_object(G, V, ns, "samplerpools", name, {"spec": spec})


class Gateway:
    """The pool's gateway pod, reached on the node's network."""

    def __init__(self, api: Api, ns: str, pool: str, port: int) -> None:
        self.api, self.ns, self.pool = api, ns, pool
        self.url = f"http://127.0.0.1:{port}"

    def diagnose(self) -> str:
        """What a failure message needs: the gateway's Deployment, pods and their logs."""
        k, ns, sel = self.api.cluster.kubectl, self.ns, "app.kubernetes.io/name=sampler-gateway"
        out = [k("-n", ns, "get", "deploy,rs,pods,samplerreplicas", "-o", "wide", check=False),
               k("-n", ns, "describe", "pods", "-l", sel, check=False)[-3000:],
               k("-n", ns, "logs", "-l", sel, "--tail", "60", check=False)[-4000:]]
        for name in replica_pods(self.api, ns, self.pool):
            out.append(f"--- {name}\n" + k("-n", ns, "logs", name, "--tail", "40", check=False)[-3000:])
        return "\n".join(out)

    def health(self) -> dict[str, Any]:
        try:
            body: dict[str, Any] = httpx.get(self.url + "/health", timeout=5).json()
            return body
        except (httpx.HTTPError, ValueError):
            return {}

    def wait(self, pred: Callable[[dict[str, Any]], bool], what: str, timeout: float) -> dict[str, Any]:
        last: dict[str, Any] = {}

        def check() -> Any:
            nonlocal last
            last = self.health()
            return bool(last) and pred(last) and last
        try:
            return ks.wait_for(check, timeout, 0.2, f"gateway: {what}")
        except TimeoutError as e:
            raise TimeoutError(f"{e}; last /health: {json.dumps(last)[:3000]}\n{self.diagnose()}") from None


def replica_pods(api: Api, ns: str, pool: str) -> list[str]:
    """The names of the pool's replica pods (not its gateway's)."""
    return [p.metadata.name for p in api.live_pods(ns)
            if p.metadata.name.startswith(f"{pool}-") and "gateway" not in p.metadata.name]


def load_log(api: Api, ns: str, pool: str) -> str:
    """Each replica pod's last load, as its log tells it (validation, drain and write times)."""
    out = []
    for name in replica_pods(api, ns, pool):
        lines = [ln for ln in api.pod_log(ns, name).splitlines() if "loaded checkpoint" in ln]
        out.append(f"{name}: {lines[-1].split('loaded checkpoint', 1)[1].strip() if lines else '-'}")
    return "; ".join(out)


def eligible_at(h: dict[str, Any], names: set[str], label: str | None) -> bool:
    return {r["name"] for r in h.get("replicas", []) if r["eligible"] and (
        label is None or r["weights_label"] == label)} == names


def sample_body(max_tokens: int) -> Callable[[int], dict[str, Any]]:
    def body(n: int) -> dict[str, Any]:
        return {"prompts": [[1, 17, 42, 3 + n % 200]],
                "sampling_params": {"max_tokens": max_tokens, "temperature": 1.0, "seed": n}}
    return body


class Reading(NamedTuple):
    at: float  # monotonic time when this round began: both reads below came after it
    started: float | None  # the answering process's `process_start_time_seconds`: which pod it was
    admitted: int | None
    status: str | None  # /health's
    label: str | None


class PodCounter(Poller):
    """Reads a replica port's `/metrics` (its process's start time and admitted requests) and THEN its
    `/health`, over and over. The start time says which pod answered, so the old pod's readings and
    its replacement's are told apart by the pods themselves, not by catching the old pod's last
    seconds. A request admitted before a read of /health happened before it, so "admitted > 0 while
    /health was not yet at the target" is a real violation, never an artefact of the two reads."""
    interval = 0.05

    def __init__(self, port: int) -> None:
        self.base = f"http://127.0.0.1:{port}"
        self.seen: list[Reading] = []
        self.start()

    def _get(self, path: str) -> bytes | None:
        try:
            with urllib.request.urlopen(self.base + path, timeout=2) as r:
                return bytes(r.read())
        except urllib.error.HTTPError as e:
            return bytes(e.read())
        except OSError:
            return None

    def poll(self) -> None:
        at = time.monotonic()
        text = self._get("/metrics")
        started = admitted = None
        if text is not None:
            page = text.decode()
            started = total(page, "process_start_time_seconds") or None
            admitted = int(total(page, "sampler_requests_admitted_total"))
        raw = self._get("/health")
        h = json.loads(raw) if raw else {}
        self.seen.append(Reading(at, started, admitted, h.get("status"), h.get("weights_label")))


def assert_clean(answers: list[Answer], what: str, gw: Gateway) -> None:
    failed = [(a.status, a.error) for a in answers if a.status != 200]
    assert not failed, f"{what}: {len(failed)} of {len(answers)} failed: {failed[:5]}\n{gw.diagnose()}"
    unstamped = [a.body for a in answers if not a.stamped]
    assert not unstamped, f"{what}: unstamped answers: {unstamped[:2]}"


# ------------------------------------------------------------------------------------------ tests
@pytest.mark.vllm
@pytest.mark.timeout(1500)  # three vLLM starts (one a replacement) and five loads under load, on 2 cores
def test_rollouts_under_load_on_real_vllm_drain_keep_then_a_replacement_mid_rollout(api, ns, operator, tiny_model,
                                                                                    tmp_path):
    """One pool of 2 REAL vLLM replicas through three rollouts (its vLLM starts are most of this test's
    time, so the three share them): Drain step-1 -> step-2 -> step-3 (acceptance 2), Keep step-3 -> step-4
    (issue #22 acceptance 4, `_keep_rollout`), then Drain step-4 -> step-5 with a replica's write failing
    midway (acceptance 3, `_replacement_mid_rollout`)."""
    from tests.support.checkpoints import hf_prompt_logprobs
    model = Path(tiny_model)
    root = tmp_path / "checkpoints"
    _checkpoints(model, root, 1, 2, 3, 4, 5)
    base, gw_port = net.free_ports(2), ks.free_port()
    template = _vllm_replica("t", base, model, root)["spec"]
    # Two CPU engines share this node's cores (no exclusive CPUs): vLLM's default binding pins every
    # engine's worker to the same core, and a replacement's engine start then stalls for minutes
    # beside a busy engine (docs/guide/operations.md, "CPU replicas sharing a node").
    template["pod"]["env"] = [{"name": "VLLM_CPU_OMP_THREADS_BIND", "value": "nobind"}]
    t0 = time.monotonic()
    apply_pool(api, ns, pool_body("rl", 2, template, gw_port, weights=weights(1)))
    wait_pool(api, ns, "rl", 2, "step-1", timeout=900)
    _log(f"pool rl: 2 vLLM replicas at step-1 in {time.monotonic() - t0:.0f}s")
    gw = Gateway(api, ns, "rl", gw_port)
    gw.wait(lambda h: eligible_at(h, {"rl-0", "rl-1"}, "step-1"), "both replicas eligible at step-1", 300)
    key, admin = pool_key(api, ns, "rl"), pool_key(api, ns, "rl", "admin-api-key")

    # --- acceptance 2: step-1 -> step-2 -> step-3 under a closed loop of 16
    loop = ClosedLoop(gw.url + "/v1/sample", sample_body(16), 16, key).start()
    loop.wait_for(32, 300, "load through the gateway")
    for step in (2, 3):
        t = time.monotonic()
        patch_pool(api, ns, "rl", {"weights": weights(step)})
        wait_pool(api, ns, "rl", 2, f"step-{step}", timeout=600)
        _log(f"rollout to step-{step} under load: {time.monotonic() - t:.1f}s; {load_log(api, ns, 'rl')}")
        loop.wait_for(16, 300, f"answers at step-{step}")
    answers = loop.stop()
    assert_clean(answers, "rollout under load", gw)
    labels = [a.label for a in sorted(answers, key=lambda a: a.received)]
    assert {"step-1", "step-2", "step-3"} <= set(labels), sorted(set(labels))
    assert older_after_newer(answers, ["step-1", "step-2", "step-3"]) == []
    _log(f"rollout: {len(answers)} answers, per replica "
         f"{ {r: sum(a.replica == r for a in answers) for r in ('rl-0', 'rl-1')} }")
    # Greedy prompt logprobs through the gateway and on each replica: step-3's.
    reference = hf_prompt_logprobs(root / "step-3", PROMPT)
    greedy = {"prompts": [PROMPT], "sampling_params": {"max_tokens": 1, "temperature": 0.0, "prompt_logprobs": True}}
    for url in (gw.url, f"http://127.0.0.1:{base}", f"http://127.0.0.1:{base + 1}"):
        code, out = post(url + "/v1/sample", greedy, key=key)
        assert code == 200 and out["weights_label"] == "step-3", out
        assert _close(list(out["results"][0]["prompt_logprobs"][1:]), reference), (url, out)

    # --- issue #22 acceptance 4: a Keep rollout to step-4 on the same pods
    _keep_rollout(api, ns, gw, key)

    # --- acceptance 3: a replica's write fails midway while the pool rolls out step-5 (Drain again)
    _replacement_mid_rollout(api, ns, gw, key, admin, base)


def _replacement_mid_rollout(api: Api, ns: str, gw: Gateway, key: str, admin: str, base: int) -> None:
    """rl-1's write of step-5 fails midway (the test seam) while the pool rolls out step-5 with Drain: its
    replacement pod admits nothing before it reports step-5, and the pool ends at 2/2 on step-5."""
    counter = PodCounter(base + 1)
    loop = ClosedLoop(gw.url + "/v1/sample", sample_body(16), 16, key).start()
    try:
        loop.wait_for(16, 300, "load before step-5")
        patch_pool(api, ns, "rl", {"rollout": {"mode": "Drain"}, "weights": weights(5)})
        # rl-0 is the first batch (given step-5: a fact that stays, unlike its drain mark, which a
        # fast load may remove before a poll sees it); rl-1 is still to come when its write fails.
        ks.wait_for(lambda: api.custom.get_namespaced_custom_object(G, V, ns, "samplerreplicas", "rl-0")
                    ["spec"]["weights"]["versionLabel"] == "step-5", 60, 0.1, "rl-0 given step-5")
        old_pod = api.custom.get_namespaced_custom_object(G, V, ns, "samplerreplicas", "rl-1")["status"]["podName"]
        code, out = post(f"http://127.0.0.1:{base + 1}/v1/checkpoints/load",
                         {"path": "/checkpoints/step-5", "version_label": "step-5", "test_fail_after_tensors": 1},
                         key=admin)
        failed_at = time.monotonic()
        assert code == 500 and out["error"]["category"] == "weight_write_failed", out
        ks.wait_for(lambda: api.events(ns, "rl-1", "UncertainWeights"), 60, 0.25, "UncertainWeights on rl-1")
        t = time.monotonic()
        try:
            st = wait_pool(api, ns, "rl", 2, "step-5", timeout=420)
        except TimeoutError as e:
            raise TimeoutError(f"{e}\n{gw.diagnose()}") from None
        _log(f"rl-1 uncertain -> pool 2/2 at step-5 in {time.monotonic() - t:.0f}s")
        loop.wait_for(16, 300, "answers at step-5")
    finally:
        answers = loop.stop()
        counter.stop()
    rl1 = api.status(ns, "rl-1")
    assert rl1["replacements"] == 1 and rl1["podName"] != old_pod, rl1
    assert rl1["lastReplacement"]["reason"] == "UncertainWeights" and rl1["lastReplacement"]["oldPod"] == old_pod, rl1
    assert [r["weightsLabel"] for r in st["replicaStatus"]] == ["step-5", "step-5"], st
    # The old pod: its first readings (the counter started long before the failed write). Every round
    # that began after the failed write returned and reached it reports the uncertain write, never a
    # label it might serve. (The operator may replace it within milliseconds, so a round may not reach it.)
    seen = counter.seen
    old = next((r for r in seen if r.started is not None), None)
    assert old is not None and old.at < failed_at, f"no reading of the old pod's /metrics: {seen[:3]}"
    old_start = old.started
    after_failure = [r for r in seen if r.started == old_start and r.at > failed_at and r.status is not None]
    assert all(r.status == "uncertain_weights" for r in after_failure), after_failure[:5]
    # The replacement pod: the readings of another process. Before its first `ok` at step-5 it admitted
    # nothing. (A round whose /health got no answer tells nothing about when its count was taken.)
    new = [r for r in seen if r.started not in (None, old_start)]
    _log(f"rl-1's port read {len(seen)} times: the old pod {sum(r.started == old_start for r in seen)} "
         f"({len(after_failure)} after its failed write), the replacement {len(new)}")
    first_ok = next((i for i, r in enumerate(new) if r.status == "ok" and r.label == "step-5"), None)
    assert first_ok is not None, f"the replacement never reported ok at step-5: {new[-5:] or seen[-5:]}"
    early = [(round(r.at, 2), r.admitted, r.status, r.label) for r in new[:first_ok]
             if r.admitted and r.status is not None]
    assert not early, f"the replacement admitted requests before it reported step-5: {early}"
    assert any(r.status == "starting" for r in new[:first_ok]), \
        f"the replacement's start was not observed: {new[:first_ok][:5]}"
    # The client: only clear errors while no replica could take work (both out), never a hang, and no
    # older version after a newer one.
    assert all(a.status != 0 for a in answers), [a.error for a in answers if a.status == 0][:3]
    assert all(a.body.get("error", {}).get("category") for a in answers if a.status != 200)
    assert older_after_newer(answers, ["step-4", "step-5"]) == []
    assert [a.label for a in sorted(answers, key=lambda a: a.received) if a.status == 200][-1] == "step-5"


def _keep_rollout(api: Api, ns: str, gw: Gateway, key: str) -> None:
    """Issue #22 acceptance 4: `rollout.mode: Keep` (step-3 -> step-4) on the pool of 2 REAL vLLM replicas
    under a closed loop through the gateway pod: every replica loads in place (none drained, none
    replaced); 0 failed, 0 samples lost (each has all its tokens); samples in flight continue onto the new
    weights (two spans, old then new); by the spans' last token no answer is older than one received
    before it was sent (Latest); the pool reports RolloutComplete at step-4."""
    from tests.support.spans import by_last_token, crossed, span_problems
    pods = {n: api.status(ns, n)["podName"] for n in ("rl-0", "rl-1")}
    max_tokens = 48

    def sample(n: int) -> dict[str, Any]:
        return {"prompts": [[1, 17, 42, 3 + n % 200]], "sampling_params": {
            "max_tokens": max_tokens, "temperature": 1.0, "seed": n, "ignore_eos": True}}

    loop = ClosedLoop(gw.url + "/v1/sample", sample, 8, key).start()
    try:
        loop.wait_for(16, 300, "load through the gateway at step-3")
        t = time.monotonic()
        patch_pool(api, ns, "rl", {"rollout": {"mode": "Keep"}, "weights": weights(4)})
        st = wait_pool(api, ns, "rl", 2, "step-4", timeout=600)
        _log(f"keep rollout to step-4 under load: {time.monotonic() - t:.1f}s; {load_log(api, ns, 'rl')}")
        # The condition names its target: the one of the Drain rollout before (step-3) does not pass.
        ks.wait_for(lambda: any(c["type"] == "Progressing" and c["reason"] == "RolloutComplete"
                                and c["message"].endswith("updated to step-4")
                                for c in pool_status(api, ns, "rl").get("conditions") or []), 60, 0.5,
                    "RolloutComplete at step-4")
        loop.wait_for(16, 300, "answers at step-4")
    finally:
        answers = loop.stop()
    order = ["step-3", "step-4"]
    assert_clean(answers, "keep rollout under load", gw)
    lost = [(a.replica, p) for a in answers if (p := span_problems(a, order, max_tokens))]
    assert not lost, f"{len(lost)} answers not whole: {lost[:5]}"
    labelled = by_last_token(answers, order)
    assert [a.label for a in labelled] == [a.body["weights_label"] for a in labelled], \
        "an answer's weights_label is not its last token's"
    assert older_after_newer(labelled, order) == []
    assert {a.label for a in labelled} == set(order)
    continued = [a for a in answers if crossed(a)]
    _log(f"keep rollout: {len(answers)} answers, {len(continued)} continued across the load")
    assert continued, "no sample lived through a keep load: nothing was tested"
    # In place: the same pods (none replaced), each load told Keep.
    assert {n: api.status(ns, n)["podName"] for n in pods} == pods
    for pod in pods.values():  # issue #33: the Keep push ran under the restricted contexts (the default)
        assert_restricted(pod)
    for n in pods:
        w = api.custom.get_namespaced_custom_object(G, V, ns, "samplerreplicas", n)["spec"]["weights"]
        assert (w["inFlight"], w.get("kv")) == ("Keep", "Keep"), w
    assert [r["weightsLabel"] for r in st["replicaStatus"]] == ["step-4", "step-4"], st


def test_scale_down_under_load_loses_nothing_and_the_leaver_gets_no_new_work(api, ns, operator, tiny_model):
    model = Path(tiny_model)
    base, gw_port = net.free_ports(3), ks.free_port()
    template = replica("t", base, model)["spec"]        # the fake engine: 1 ms per token
    apply_pool(api, ns, pool_body("dr", 3, template, gw_port))
    wait_pool(api, ns, "dr", 3, None, timeout=300)
    gw = Gateway(api, ns, "dr", gw_port)
    gw.wait(lambda h: eligible_at(h, {"dr-0", "dr-1", "dr-2"}, None), "3 replicas eligible", 300)
    key = pool_key(api, ns, "dr")
    marked: dict[str, float] = {}
    stop = threading.Event()

    def watch_mark() -> None:
        from kubernetes import watch
        w = watch.Watch()
        for ev in w.stream(api.custom.list_namespaced_custom_object, G, V, ns, "samplerreplicas",
                           field_selector="metadata.name=dr-2", timeout_seconds=300):
            if (ev["object"]["metadata"].get("annotations") or {}).get(DRAINING) == "true":
                marked.setdefault("at", time.monotonic())
            if stop.is_set() or "at" in marked:
                w.stop()

    watcher = threading.Thread(target=watch_mark, daemon=True)
    watcher.start()
    # 200 tokens at 1 ms: requests are in flight on every replica when the mark lands.
    loop = ClosedLoop(gw.url + "/v1/sample", sample_body(200), 16, key).start()
    try:
        loop.wait_for(48, 120, "load on 3 replicas")
        patch_pool(api, ns, "dr", {"replicas": 2})
        ks.wait_for(lambda: "at" in marked, 60, 0.05, "dr-2 marked draining")
        ks.wait_for(lambda: not any(o["metadata"]["name"] == "dr-2" for o in api.custom.list_namespaced_custom_object(
            G, V, ns, "samplerreplicas")["items"]), 120, 0.2, "dr-2 deleted once drained")
        wait_pool(api, ns, "dr", 2, None, timeout=60)
        loop.wait_for(16, 60, "answers from the 2 left")
    finally:
        stop.set()
        answers = loop.stop()
    assert_clean(answers, "scale 3 -> 2 under load", gw)
    grace = marked["at"] + 1.0     # one gateway refresh at most (docs/design/failover.md)
    late = [a for a in answers if a.replica == "dr-2" and a.sent > grace]
    assert not late, f"{len(late)} requests sent > 1 s after the drain mark reached dr-2"
    assert any(a.replica == "dr-2" for a in answers), "dr-2 took no load before the mark: nothing was tested"
    # dr-2 was deleted only after its requests ended: none of them failed (assert_clean above).
