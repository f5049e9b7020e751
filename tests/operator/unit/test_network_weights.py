"""Issue #51 (phases D and E), the operator's pure parts: `spec.weights` declaring weights pushed over the
network (`sha256`, no checkpoint) and the template's `weightTransfer.backend`; what a replica's load and a
new pod are given (the digest, and the pool's ready replicas serving it as `peers`); the peers chosen; the
pool's NetworkPolicy opening exactly gloo's traffic (measured: tests/engine/test_gloo_connections.py)."""
from __future__ import annotations

from typing import Any

import pytest

from sampler_operator.health_probe import HealthObservation, HealthState
from sampler_operator.network_policy import ANY_TCP_PORT, OperatorPeer, pool_policies, replica_policy
from sampler_operator.pool.plan import PoolSpec, declared_key, pool_owner_ref, pool_status, rejection, replica_body
from sampler_operator.pool.plan import ReplicaState as RS
from sampler_operator.replica.desired_pod import Owner, desired_pod, sampler_args
from sampler_operator.replica.spec import InvalidSpec, parse_spec
from sampler_operator.replica.weights_intent import (
    WEIGHTS_UNAVAILABLE,
    WeightsRef,
    declared_load_request,
    declared_outcome,
    declared_ref,
    needs_declared_load,
    observed_weights,
    startup_weights,
    weights_synced,
)
from sampler_operator.replica.weights_sync import peer_urls, serving

SHA = "ab" * 32
BASE = {"model": "/models/tiny", "image": "img", "checkpoints": {"allowedRoots": ["/ckpt"]}}


def test_declared_weights_need_a_checkpoint_or_a_digest_and_the_digest_is_hex() -> None:
    pushed = parse_spec({**BASE, "weights": {"versionLabel": "net-1", "sha256": SHA.upper(), "step": 3}})
    assert declared_ref(pushed) == WeightsRef(None, "net-1", step=3, sha256=SHA)
    both = parse_spec({**BASE, "weights": {"versionLabel": "net-1", "sha256": SHA, "checkpoint": "/ckpt/n1"}})
    assert declared_ref(both) == WeightsRef("/ckpt/n1", "net-1", sha256=SHA)
    for weights, why in (({"versionLabel": "x"}, "needs checkpoint"), ({"versionLabel": "x", "sha256": "zz" * 32},
                                                                       "spec.weights.sha256"),
                         ({"versionLabel": "x", "sha256": SHA, "sha256Manifest": {"a": "b"}}, "sha256Manifest"),
                         ({"versionLabel": "x", "sha256": SHA, "checkpoint": "/elsewhere"}, "allowedRoots")):
        with pytest.raises(InvalidSpec) as e:
            parse_spec({**BASE, "weights": weights})
        assert why in str(e.value), (weights, str(e.value))
    with pytest.raises(InvalidSpec) as e:
        parse_spec({**BASE, "weightTransfer": {"backend": "nccl"}})  # gloo only, for now
    assert "weightTransfer.backend" in str(e.value)


def test_the_backend_is_the_samplers_flag_and_pushed_weights_its_initial_digest() -> None:
    spec = parse_spec({**BASE, "weightTransfer": {"backend": "gloo"}})
    args = sampler_args(spec)
    assert args[args.index("--weight-transfer-backend") + 1] == "gloo"
    assert "--weight-transfer-backend" not in sampler_args(parse_spec(BASE))  # as before the field existed
    pod = desired_pod(Owner("r", "ns", "uid"), spec, 0, WeightsRef(None, "net-1", step=3, sha256=SHA))
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["SAMPLER_INITIAL_VERSION_LABEL"] == "net-1" and env["SAMPLER_INITIAL_SHA256"] == SHA
    assert env["SAMPLER_INITIAL_STEP"] == "3" and "SAMPLER_INITIAL_CHECKPOINT" not in env


def test_a_load_by_digest_names_the_peers_and_only_a_digest_makes_it_one() -> None:
    spec = parse_spec({**BASE, "weights": {"versionLabel": "net-1", "sha256": SHA, "step": 2, "inFlight": "Keep"}})
    assert declared_load_request(spec, ["http://10.0.0.2:8000"]) == {
        "version_label": "net-1", "step": 2, "sha256": SHA, "peers": ["http://10.0.0.2:8000"], "in_flight": "keep",
        "kv": "keep"}
    ckpt = parse_spec({**BASE, "weights": {"versionLabel": "s1", "checkpoint": "/ckpt/s1"}})
    assert declared_load_request(ckpt, ["http://10.0.0.2:8000"]) == {"version_label": "s1", "path": "/ckpt/s1"}


def _replica(name: str, phase: str = "Ready", sha: str | None = SHA, ip: str | None = "10.0.0.2",
             port: int = 8000) -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {"port": port},
            "status": {"phase": phase, "podIP": ip, "weights": {"label": "net-1", "sha256": sha}}}


def test_a_declaration_by_digest_once_acted_on_is_not_loaded_again() -> None:
    """The status is written with merge patches, which drop a null: what records the declaration acted on
    must compare equal to the declaration after that (a pushed label loaded again and again otherwise)."""
    spec = parse_spec({**BASE, "weights": {"versionLabel": "net-1", "sha256": SHA, "step": 2}})
    acted = declared_outcome(spec, "Loaded", "ok")
    written = {k: v for k, v in acted.items() if v is not None}
    written["declared"] = {k: v for k, v in acted["declared"].items() if v is not None}
    assert needs_declared_load(spec, {}) and not needs_declared_load(spec, written)


def test_the_peers_are_the_pools_ready_replicas_serving_the_digest_itself_left_out() -> None:
    replicas = [_replica("p-2", ip="10.0.0.3", port=8002), _replica("p-0"), _replica("p-1", ip="fd00::1"),
                _replica("p-3", phase="Starting"), _replica("p-4", sha="cd" * 32), _replica("p-5", ip=None),
                _replica("p-6", sha=SHA.upper())]
    assert peer_urls("p-0", SHA, replicas) == ["http://[fd00::1]:8000", "http://10.0.0.3:8002",
                                               "http://10.0.0.2:8000"]
    assert peer_urls("p-0", SHA, []) == []


def test_a_pod_serving_the_digest_under_the_label_serves_the_declaration() -> None:
    ref = WeightsRef(None, "net-1", sha256=SHA)
    obs = HealthObservation(HealthState.OK, weights_label="net-1", weights_sha256=SHA.upper())
    assert serving(obs, ref)
    assert not serving(HealthObservation(HealthState.OK, weights_label="net-0", weights_sha256=SHA), ref)
    assert not serving(HealthObservation(HealthState.OK, weights_label="net-1", weights_sha256="cd" * 32), ref)
    assert serving(HealthObservation(HealthState.OK, weights_label="s1", weights_checkpoint="/ckpt/s1"),
                   WeightsRef("/ckpt/s1", "s1"))


def test_pushed_weights_are_what_a_replacement_starts_at_and_their_digest_is_in_the_status() -> None:
    spec = parse_spec({**BASE, "weights": {"versionLabel": "net-1", "sha256": SHA}})
    obs = HealthObservation(HealthState.OK, weights_label="net-1", weights_version=3, weights_sha256=SHA,
                            intended={"checkpoint": None, "version_label": "net-1", "step": 4, "sha256": SHA})
    weights = observed_weights(obs, "r-0", {})
    assert weights["sha256"] == SHA and weights["intended"] == {"versionLabel": "net-1", "step": 4, "sha256": SHA}
    assert weights["lastCertain"] == {"versionLabel": "net-1", "sha256": SHA}
    ref, _ = startup_weights(spec, {**weights, "declared": WeightsRef(None, "net-1", sha256=SHA).to_status()})
    assert ref == WeightsRef(None, "net-1", step=4, sha256=SHA)
    # Found nowhere: the condition says so, on a waiting pod and on a serving one.
    waiting = HealthObservation(HealthState.STARTING, reason="intended checkpoint unavailable: network push net-1")
    synced = weights_synced(spec, weights, waiting, unavailable="sha256: ... nowhere to load from")
    assert synced is not None and (synced.status, synced.reason) == (False, WEIGHTS_UNAVAILABLE)
    assert "nowhere to load from" in synced.message and "network push net-1" in synced.message


def test_a_pool_rejection_and_history_know_weights_by_their_digest() -> None:
    weights = {"versionLabel": "net-1", "sha256": SHA.upper(), "step": 5}
    spec = PoolSpec.model_validate({"replicas": 1, "template": BASE, "weights": weights})
    assert declared_key(weights) == (None, "net-1", SHA)
    body = replica_body("p", "ns", "uid", spec, 0)
    assert body["spec"]["weights"] == weights  # the replica is given the digest, no checkpoint
    refused = RS("p-0", "uid", None, draining=True, phase="Ready", label="net-0", rejected=(None, "net-1", SHA))
    assert rejection("uid", spec, [refused]) is refused
    other = RS("p-0", "uid", None, draining=True, phase="Ready", label="net-0", rejected=(None, "net-1", "cd" * 32))
    assert rejection("uid", spec, [other]) is None
    [entry] = pool_status("p", "uid", spec, [], 1, now=0.0)["weightsHistory"]
    assert (entry["label"], entry["sha256"], entry["checkpoint"], entry["step"]) == ("net-1", SHA, None, 5)


def test_the_pools_policy_opens_gloos_traffic_only_when_the_template_pushes() -> None:
    owner = pool_owner_ref("p", "uid")
    trainer = {"namespaceSelector": {"matchLabels": {"team": "rl"}}, "podSelector": {"matchLabels": {"app": "t"}}}
    plain, _ = pool_policies("p", "ns", owner, {"template": BASE, "weightTransfer": {"from": [trainer]}},
                             OperatorPeer("ops"))
    assert len(plain["spec"]["ingress"]) == 1  # no backend: nothing opened for it
    spec = {"template": {**BASE, "weightTransfer": {"backend": "gloo"}}}
    no_trainer, _ = pool_policies("p", "ns", owner, spec, OperatorPeer("ops"))
    http, mesh = no_trainer["spec"]["ingress"]
    assert mesh == {"ports": ANY_TCP_PORT, "from": [{"podSelector": {"matchLabels": {
        "sampler.rl.dev/pool": "p", "app.kubernetes.io/name": "sampler"}}}]}  # replica to replica, every port
    pushed, _ = pool_policies("p", "ns", owner, {**spec, "weightTransfer": {"from": [trainer]}}, OperatorPeer("ops"))
    assert pushed["spec"]["ingress"][:2] == [http, mesh]
    assert pushed["spec"]["ingress"][2] == {"ports": [{"protocol": "TCP"}], "from": [trainer]}
    lone = replica_policy("r", "ns", owner, 8000, [trainer], OperatorPeer("ops"), "gloo")
    assert lone["spec"]["ingress"][1] == {"ports": [{"protocol": "TCP"}], "from": [trainer]}
    assert len(replica_policy("r", "ns", owner, 8000, [trainer], OperatorPeer("ops"))["spec"]["ingress"]) == 1
