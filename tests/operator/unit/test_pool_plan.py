"""The SamplerPool controller's pure decisions: owned replicas, scale, batched rollout, status."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import yaml

from sampler_operator.api_keys import replica_keys
from sampler_operator.pool.conditions import rollout_events
from sampler_operator.pool.plan import (
    ANNOTATION_DRAINING,
    ANNOTATION_DRAINING_SINCE,
    ANNOTATION_SPEC_HASH,
    ROUTING_GRACE_S,
    LoadAnswer,
    Plan,
    PoolSpec,
    ReplicaState,
    declared_key,
    desired_replica_spec,
    keys_secret,
    leaving,
    plan,
    pool_keys,
    pool_status,
    replica_body,
    replica_spec,
    spec_hash,
)
from sampler_operator.replica.spec import parse_spec
from sampler_operator.replica.status import iso, parse_iso
from tests.support import REPO_ROOT

UID = "uid-1"
TEMPLATE = {"model": "/models/tiny", "image": "img", "engine": "fake", "checkpoints": {"allowedRoots": ["/ckpt"]}}


def spec(replicas: int = 3, label: str | None = "step-1", max_unavailable: int = 1, mode: str = "Drain") -> PoolSpec:
    weights = {"checkpoint": f"/ckpt/{label}", "versionLabel": label} if label else None
    return PoolSpec.model_validate({"replicas": replicas, "template": TEMPLATE, "weights": weights,
                                    "rollout": {"maxUnavailable": max_unavailable, "mode": mode}})


def at(s: PoolSpec, name: str, *, phase: str = "Ready", label: str | None = None, draining: bool = False,
       owner: str | None = UID) -> ReplicaState:
    return ReplicaState(name, owner, spec_hash(desired_replica_spec("p", s)), draining, phase,
                        label if label is not None else s.target_label)


def test_replica_body_is_owned_labelled_and_a_valid_replica_spec() -> None:
    body = replica_body("p", "ns", UID, spec(), 2)
    meta = body["metadata"]
    assert meta["name"] == "p-2" and meta["labels"]["sampler.rl.dev/pool"] == "p"
    assert meta["ownerReferences"] == [{"apiVersion": "sampler.rl.dev/v1alpha1", "kind": "SamplerPool", "name": "p",
                                        "uid": UID, "controller": True, "blockOwnerDeletion": True}]
    assert body["spec"]["pool"] == "p" and body["spec"]["weights"]["versionLabel"] == "step-1"
    assert meta["annotations"][ANNOTATION_SPEC_HASH] == spec_hash(body["spec"])
    parse_spec(body["spec"])  # the replica controller accepts it
    state = ReplicaState.from_object({**body, "status": {"phase": "Ready", "weights": {"label": "step-1"}}})
    assert state == ReplicaState("p-2", UID, spec_hash(body["spec"]), False, "Ready", "step-1")


def test_scale_up_and_down_only_touches_its_own_replicas() -> None:
    s = spec(replicas=3)
    foreign = at(s, "p-7", owner="someone-else")
    assert plan("p", UID, s, [at(s, "p-1"), foreign]) == Plan(create=[0, 2])
    down = spec(replicas=1)
    got = plan("p", UID, down, [at(down, "p-0"), at(down, "p-1"), at(down, "p-2"), foreign])
    # Drained first, highest index first; the foreign one is never touched.
    assert got == Plan(retire=["p-2", "p-1"])


def leaving_at(s: PoolSpec, name: str, since: float) -> ReplicaState:
    return replace(at(s, name, draining=True), leaving_since=since)


def test_a_scaled_away_replica_is_deleted_once_idle_or_after_the_drain_timeout() -> None:
    s = spec(replicas=1)  # drainTimeoutSeconds: 30 by default
    reps = [at(s, "p-0"), leaving_at(s, "p-1", since=100.0), leaving_at(s, "p-2", since=100.0)]
    assert [r.name for r in leaving("p", UID, s, reps)] == ["p-1", "p-2"]
    # Idle, but the gateway may not have seen the mark yet: wait.
    assert plan("p", UID, s, reps, 100.0 + ROUTING_GRACE_S - 0.5, {"p-1": 0, "p-2": 0}) == Plan(
        leaving=["p-2", "p-1"])
    # Past the grace: the idle one goes; the busy one and the unknown one wait.
    assert plan("p", UID, s, reps, 100.0 + ROUTING_GRACE_S, {"p-1": 0, "p-2": 4}) == Plan(
        delete=["p-1"], leaving=["p-2"])
    assert plan("p", UID, s, reps, 110.0, {"p-1": None, "p-2": 4}).delete == []
    # The timeout ends every wait.
    assert plan("p", UID, s, reps, 130.0, {"p-1": None, "p-2": 4}) == Plan(delete=["p-2", "p-1"])
    short = PoolSpec.model_validate({**s.model_dump(by_alias=True), "rollout": {"drainTimeoutSeconds": 0}})
    assert plan("p", UID, short, [at(short, "p-0"), leaving_at(short, "p-1", 100.0)], 100.0).delete == ["p-1"]


def test_a_replica_wanted_again_while_leaving_comes_back_into_routing() -> None:
    s = spec(replicas=2)
    assert plan("p", UID, s, [at(s, "p-0"), leaving_at(s, "p-1", 100.0)], 101.0) == Plan(undrain=["p-1"])


def test_the_drain_mark_and_its_time_are_read_from_annotations() -> None:
    obj: dict[str, Any] = {"metadata": {"name": "p-1", "annotations": {
        ANNOTATION_DRAINING: "true", ANNOTATION_DRAINING_SINCE: "2026-01-01T00:00:10Z"}},
        "spec": {"port": 8000}, "status": {"podIP": "10.0.0.7"}}
    st = ReplicaState.from_object(obj)
    assert st.leaving_since == parse_iso("2026-01-01T00:00:10Z") and (st.pod_ip, st.port) == ("10.0.0.7", 8000)
    obj["metadata"]["annotations"][ANNOTATION_DRAINING_SINCE] = "soon"
    assert ReplicaState.from_object(obj).leaving_since is None  # edited by hand: retired again from now


def test_weights_roll_out_at_most_max_unavailable_at_a_time() -> None:
    old, new = spec(label="step-1"), spec(label="step-2")
    replicas = [at(old, f"p-{i}") for i in range(3)]
    first = plan("p", UID, new, replicas)
    assert first == Plan(update=["p-0"])
    # p-0 got the new spec and drains; until it reports step-2 and Ready nothing else moves.
    loading = [at(new, "p-0", label="step-1", draining=True), *replicas[1:]]
    assert plan("p", UID, new, loading) == Plan()
    assert plan("p", UID, new, [at(new, "p-0", phase="Starting", draining=True), *replicas[1:]]) == Plan()
    verified = [at(new, "p-0", draining=True), *replicas[1:]]
    assert plan("p", UID, new, verified) == Plan(update=["p-1"], undrain=["p-0"])
    # maxUnavailable 2: two at a time.
    assert plan("p", UID, spec(label="step-2", max_unavailable=2), replicas).update == ["p-0", "p-1"]
    done = [at(new, f"p-{i}") for i in range(3)]
    assert plan("p", UID, new, done).empty()
    # The weights move again while p-0 is out loading step-2: it gets step-3 at once, no extra batch.
    newer = spec(label="step-3")
    assert plan("p", UID, newer, loading) == Plan(update=["p-0"])


def test_a_template_changing_the_logprobs_mode_rolls_the_replicas_batch_by_batch() -> None:
    """engineArgs.logprobsMode in the pool's template is a template change like any other: replica by
    replica (maxUnavailable), each drained, given the new spec, and its pod replaced with the new flag."""
    from sampler_operator.replica.desired_pod import pod_template, sampler_args, template_hash

    old = spec(label="step-1")
    new = old.model_copy(update={"template": {**TEMPLATE, "engineArgs": {"logprobsMode": "processed_logprobs"}}})
    replicas = [at(old, f"p-{i}") for i in range(3)]
    assert spec_hash(desired_replica_spec("p", new)) != spec_hash(desired_replica_spec("p", old))
    assert plan("p", UID, new, replicas) == Plan(update=["p-0"])
    assert plan("p", UID, new, [at(new, "p-0", phase="Starting", draining=True), *replicas[1:]]) == Plan()
    assert plan("p", UID, new, [at(new, "p-0", draining=True), *replicas[1:]]) == Plan(update=["p-1"], undrain=["p-0"])
    # The replica's own controller then replaces the pod: another template, the flag on the sampler.
    before, after = (parse_spec(replica_spec("p", s, 0)) for s in (old, new))
    assert template_hash(pod_template("p-0", after)) != template_hash(pod_template("p-0", before))
    args = sampler_args(after)
    assert args[args.index("--logprobs-mode") + 1] == "processed_logprobs"


def test_an_outdated_replica_being_replaced_takes_the_target_at_once_outside_the_budget() -> None:
    old, new = spec(label="step-1"), spec(label="step-2")
    loading = at(new, "p-0", label="step-1", draining=True)
    # p-2's write failed mid-rollout: its replica is replacing the pod, still at the old spec. It is
    # out of service anyway, so it gets the target now (its new pod starts there) and stays out of
    # routing until verified; p-1, serving, still waits for the budget.
    replacing = [loading, at(old, "p-1"), at(old, "p-2", phase="Replacing")]
    assert plan("p", UID, new, replacing) == Plan(update=["p-2"])
    # Unhealthy (probes unanswered under load) may still serve: it waits for the budget like any other.
    assert plan("p", UID, new, [loading, at(old, "p-1"), at(old, "p-2", phase="Unhealthy")]) == Plan()
    # Verified at the target: back in routing like any batch.
    assert plan("p", UID, new, [loading, at(old, "p-1"), at(new, "p-2", draining=True)]) == Plan(undrain=["p-2"])


def test_a_replica_already_down_counts_against_max_unavailable() -> None:
    """As a Deployment's rolling update: the pool keeps at least replicas - maxUnavailable in routing,
    so a replica that is already down (its pod lost, the next one starting) uses the budget. It was:
    p-0 down took the new spec for free AND p-1 was drained in the same step, READY 0/2."""
    old, new = spec(replicas=2, label="step-1"), spec(replicas=2, label="step-2")
    for phase in ("Starting", "Pending", "Replacing", "ReplacementQueued", "Degraded"):
        down = [at(old, "p-0", phase=phase), at(old, "p-1")]
        # The down one takes the target at once (it serves nothing either way); p-1 stays in routing.
        assert plan("p", UID, new, down) == Plan(update=["p-0"]), phase
    # Next step: p-0 at the target, still starting (marked draining with its new spec): p-1 waits.
    starting = [at(new, "p-0", phase="Starting", label="step-1", draining=True), at(old, "p-1")]
    assert plan("p", UID, new, starting) == Plan()
    assert pool_status("p", UID, new, starting, 1)["readyReplicas"] == 1
    # p-0 back, Ready at the target: it returns to routing and p-1 is the next batch.
    assert plan("p", UID, new, [at(new, "p-0", draining=True), at(old, "p-1")]) == Plan(
        update=["p-1"], undrain=["p-0"])
    # Down for good: with maxUnavailable 1 the rollout waits for it, as a Deployment's would (its
    # ProgressDeadlineExceeded); with a budget of 2 the next replica goes on beside it.
    wide = spec(replicas=3, label="step-2", max_unavailable=2)
    stuck = [at(wide, "p-0", phase="Pending", label="step-1", draining=True), at(old, "p-1"), at(old, "p-2")]
    assert plan("p", UID, wide, stuck) == Plan(update=["p-1"])
    assert plan("p", UID, spec(replicas=3, label="step-2"), stuck) == Plan()
    # A replica that does not exist yet (created now, at the target) is unavailable too.
    assert plan("p", UID, spec(replicas=3, label="step-2"), [at(old, "p-0"), at(old, "p-1")]) == Plan(create=[2])
    # Unhealthy (probes unanswered under load) may still serve: it does not use the budget.
    assert plan("p", UID, new, [at(old, "p-0", phase="Unhealthy"), at(old, "p-1")]) == Plan(update=["p-0"])


def test_a_replica_waiting_for_pushed_weights_nobody_serves_yet_does_not_hold_the_rollout() -> None:
    """Weights pushed over the network while p-1 was down (its pod lost, the next one starting): p-1 took
    the target at once and waits for a peer serving it; p-0 holds the push, but writes it only when the
    rollout reaches it. Counted against the budget, p-1 would hold the rollout for good (each waiting for
    the other: the demo's loop hung so). It uses none while nobody serves the target: p-0 is the next
    batch, and p-1 catches up from it once it does."""
    digest = "ab" * 32
    old = spec(replicas=2, label="step-1")
    new = PoolSpec.model_validate({"replicas": 2, "template": TEMPLATE,
                                   "weights": {"versionLabel": "net-2", "sha256": digest.upper()},
                                   "rollout": {"maxUnavailable": 1, "mode": "Drain"}})
    waiting = f"intended checkpoint unavailable: network push net-1; sha256 {digest}: no peer holds them"
    down = replace(at(new, "p-1", phase="Starting", label="step-1", draining=True), unavailable=waiting)
    assert plan("p", UID, new, [at(old, "p-0"), down]) == Plan(update=["p-0"])
    # What the replica's own controller wrote, read back as the pool's controller sees it.
    body = replica_body("p", "ns", UID, new, 1)
    body["status"] = {"phase": "Starting", "conditions": [
        {"type": "WeightsSynced", "status": "False", "reason": "WeightsUnavailable", "message": waiting}]}
    assert ReplicaState.from_object(body).unavailable == waiting
    # ...and the controls: as before, the down replica holds the rollout when it waits for anything else
    # (another digest, a pod still starting, no condition), or once a replica serves the target (it
    # catches up from that one: no reason to take another out of routing beside it).
    for other in (replace(down, unavailable=waiting.replace(digest, "cd" * 32)), replace(down, unavailable=None)):
        assert plan("p", UID, new, [at(old, "p-0"), other]) == Plan(), other
    serving = [at(new, "p-0"), down, at(old, "p-2")]
    assert plan("p", UID, PoolSpec.model_validate({**new.model_dump(by_alias=True), "replicas": 3}),
                serving).update == []
    # Checkpoint targets never skip the budget: a down replica loads those from disk by itself.
    assert plan("p", UID, spec(replicas=2, label="step-2"), [at(old, "p-0"), replace(
        at(spec(replicas=2, label="step-2"), "p-1", phase="Starting", label="step-1", draining=True),
        unavailable=waiting)]) == Plan()


def test_keep_mode_ignores_a_replica_already_down() -> None:
    """Keep takes nobody out of routing, so there is no budget for a down replica to use: the down one
    takes the target drained, every serving one loads in place."""
    old, new = spec(replicas=2, label="step-1", mode="Keep"), spec(replicas=2, label="step-2", mode="Keep")
    assert plan("p", UID, new, [at(old, "p-0", phase="Starting"), at(old, "p-1")]) == Plan(
        update=["p-0"], update_in_place=["p-1"])


def test_abort_mode_reaches_each_replica_load_and_a_mode_change_alone_rolls_nothing() -> None:
    drain, abort = spec(), spec(mode="Abort")
    assert "inFlight" not in desired_replica_spec("p", drain)["weights"]  # the spec pools have always written
    body = replica_body("p", "ns", UID, abort, 0)
    assert body["spec"]["weights"]["inFlight"] == "Abort" and parse_spec(body["spec"]).weights.in_flight == "Abort"
    assert spec_hash(desired_replica_spec("p", abort)) == spec_hash(desired_replica_spec("p", drain))
    settled = [at(drain, f"p-{i}") for i in range(3)]
    assert plan("p", UID, abort, settled).empty()
    assert pool_status("p", UID, abort, settled, 1)["updatedReplicas"] == 3
    # The next weights change is a rollout as ever, and each replica is given the mode with the weights.
    step2 = spec(label="step-2", mode="Abort")
    assert plan("p", UID, step2, settled).update == ["p-0"]
    assert desired_replica_spec("p", step2)["weights"] == {"checkpoint": "/ckpt/step-2", "versionLabel": "step-2",
                                                           "inFlight": "Abort"}


def test_declared_adapters_roll_no_replica() -> None:
    """A trainer pushes an adapter version every step (spec.adapters, docs/design/lora-pool.md): the
    replicas load versions on demand, so the push must not reach their spec, or it would roll them."""
    base = spec()
    raw = base.model_dump(by_alias=True)
    raw["adapters"] = {"serial": 1, "runs": {"a": {"versions": [{"label": "s1", "step": 1, "path": "/ckpt/a/1",
                                                               "serial": 1}]}}}
    pushed = PoolSpec.model_validate(raw)
    assert "adapters" not in desired_replica_spec("p", pushed)
    assert spec_hash(desired_replica_spec("p", pushed)) == spec_hash(desired_replica_spec("p", base))
    settled = [at(base, f"p-{i}") for i in range(3)]
    assert plan("p", UID, pushed, settled).empty()


def test_keep_mode_updates_every_serving_replica_at_once_in_routing() -> None:
    """Keep costs each replica one engine pause, not its place in routing: no batches, no drain marks
    (maxUnavailable does not apply), every replica's load at once; a replica out of service still
    takes the target drained (its new pod starts there), and a refusal stops the rollout."""
    old, new = spec(replicas=4, label="step-1", mode="Keep"), spec(replicas=4, label="step-2", mode="Keep")
    serving = [at(old, f"p-{i}") for i in range(4)]
    assert plan("p", UID, new, serving) == Plan(update_in_place=["p-0", "p-1", "p-2", "p-3"])
    weights = desired_replica_spec("p", new)["weights"]
    assert weights["inFlight"] == "Keep" and weights["kv"] == "Keep"
    assert parse_spec(replica_body("p", "ns", UID, new, 0)["spec"]).weights.in_flight == "Keep"
    # Given the spec, each loads in place: nothing more to do until they report the label, and they
    # were never out of routing, so there is nothing to undrain either.
    loading = [at(new, f"p-{i}", label="step-1") for i in range(4)]
    assert plan("p", UID, new, loading).empty()
    assert pool_status("p", UID, new, loading, 1)["readyReplicas"] == 4
    assert plan("p", UID, new, [at(new, f"p-{i}") for i in range(4)]).empty()
    # Being replaced (a write failed midway): drained onto the target, outside any budget.
    assert plan("p", UID, new, [*serving[:3], at(old, "p-3", phase="Replacing")]) == Plan(
        update=["p-3"], update_in_place=["p-0", "p-1", "p-2"])
    # A replica refused the checkpoint: no other replica is sent into the same refusal.
    assert plan("p", UID, new, [*serving[:3], rejected(new, "p-3", "bad tensor")]).update_in_place == []
    # kv is how, not what: like the mode, it rolls nothing alone.
    recompute = PoolSpec.model_validate({**new.model_dump(by_alias=True),
                                         "rollout": {"mode": "Keep", "kv": "Recompute"}})
    assert desired_replica_spec("p", recompute)["weights"]["kv"] == "Recompute"
    assert spec_hash(desired_replica_spec("p", recompute)) == spec_hash(desired_replica_spec("p", new))


def test_keep_mode_events_say_in_place() -> None:
    rolling = {"targetLabel": "step-2", "conditions": [{"type": "Progressing", "status": "True",
                                                        "reason": "RollingOut", "message": "0/2 updated"}]}
    events = rollout_events(rolling, rolling, [], ["p-0", "p-1"])
    assert events == [("Normal", "BatchUpdating", "p-0, p-1 loading step-2 in place, in routing")]


def test_status_counts_ready_and_updated() -> None:
    old, new = spec(label="step-1"), spec(label="step-2")
    replicas = [at(new, "p-0"), at(new, "p-1", label="step-1", draining=True), at(old, "p-2"),
                at(old, "x", owner="other")]
    st = pool_status("p", UID, new, replicas, 4)
    assert (st["replicas"], st["readyReplicas"], st["updatedReplicas"], st["targetLabel"]) == (3, 2, 1, "step-2")
    assert [(r["name"], r["state"]) for r in st["replicaStatus"]] == [
        ("p-0", "Updated"), ("p-1", "Updating"), ("p-2", "Outdated")]
    assert st["observedGeneration"] == 4


def test_from_object_reads_the_drain_mark() -> None:
    obj: dict[str, Any] = {"metadata": {"name": "p-0", "annotations": {ANNOTATION_DRAINING: "true"}}, "status": {}}
    st = ReplicaState.from_object(obj)
    assert st.draining and st.owner_uid is None and st.phase is None and st.label is None


def test_the_scorers_fields_are_the_gateways_flags_and_unset_ones_keep_its_defaults() -> None:
    from sampler_gateway.config import parse_config
    from sampler_operator.pool.gateway import SCORE_FLAGS, gateway_objects

    score = {"picker": "LeastLoaded", "prefixWeight": 0.5, "loadWeight": 2, "tokensWeight": 0, "queueWeight": 1.5,
             "kvWeight": 0.25, "imbalance": 8, "imbalanceRatio": 2.0, "burstWindowSeconds": 0, "indexBlocks": 4096}
    spec = {"template": {**TEMPLATE, "apiKeySecretRef": {"name": "k"}}, "routing": {"score": score}}
    keys = pool_keys("p", PoolSpec.model_validate(spec))
    dep = next(o for o in gateway_objects("p", "ns", UID, spec, keys.api, keys.admin) if o["kind"] == "Deployment")
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    cfg = parse_config(args, environ={})
    assert (cfg.picker, cfg.score_prefix_weight, cfg.score_load_weight, cfg.score_tokens_weight) == (
        "least-loaded", 0.5, 2.0, 0.0)
    assert (cfg.score_queue_weight, cfg.score_kv_weight, cfg.score_imbalance, cfg.score_imbalance_ratio) == (
        1.5, 0.25, 8, 2.0)
    assert (cfg.burst_window_s, cfg.prefix_index_blocks) == (0.0, 4096)
    # Every field of the CRD's score is passed; none unset is: the gateway's defaults stand.
    crd = yaml.safe_load((REPO_ROOT / "crds" / "samplerpool.yaml").read_text())
    routing = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["routing"]
    assert set(routing["properties"]["score"]["properties"]) == set(SCORE_FLAGS)
    bare = {**spec, "routing": {}}
    dep = next(o for o in gateway_objects("p", "ns", UID, bare, keys.api, keys.admin) if o["kind"] == "Deployment")
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not set(SCORE_FLAGS.values()) & set(args)
    assert parse_config(args, environ={}).picker == "score"


def test_gateway_objects_follow_the_pool_spec() -> None:
    from sampler_operator.pool.gateway import gateway_objects
    from sampler_operator.settings import gateway_image

    pool_spec = {"template": {**TEMPLATE, "apiKeySecretRef": {"name": "k"}, "requestTimeoutSeconds": 60},
                 "routing": {"versionPolicy": "MinVersion", "affinity": {"header": "X-Group", "replicaCapacity": 8}},
                 "gateway": {"replicas": 2, "port": 9090}, "weights": {"checkpoint": "/ckpt/s", "versionLabel": "s"}}
    keys = pool_keys("p", PoolSpec.model_validate(pool_spec))
    objs = {o["kind"]: o for o in gateway_objects("p", "ns", UID, pool_spec, keys.api, keys.admin)}
    assert list(objs) == ["ServiceAccount", "Role", "RoleBinding", "Deployment", "Service"]
    assert all(o["metadata"]["ownerReferences"][0]["uid"] == UID and o["metadata"]["name"] == "p-gateway"
               for o in objs.values())
    dep = objs["Deployment"]["spec"]
    c = dep["template"]["spec"]["containers"][0]
    # the operator's gateway image, never the template's (no sampler image carries sampler_gateway)
    assert dep["replicas"] == 2 and c["image"] == gateway_image()
    assert c["command"] == ["python", "-m", "sampler_gateway"]
    args = dict(zip(c["args"][::2], c["args"][1::2], strict=True))
    assert args == {"--pool": "p", "--namespace": "ns", "--discovery": "kube", "--host": "0.0.0.0",
                    "--port": "9090", "--version-policy": "MinVersion", "--affinity-header": "X-Group",
                    "--replica-capacity": "8", "--request-timeout-s": "60"}
    # The target label is read from the pool by the gateway, never a flag (no restart per rollout).
    assert "--target-label" not in c["args"]
    assert c["env"] == [{"name": "SAMPLER_GATEWAY_API_KEY",
                         "valueFrom": {"secretKeyRef": {"name": "k", "key": "api-key"}}},
                        {"name": "SAMPLER_GATEWAY_ADMIN_API_KEY",
                         "valueFrom": {"secretKeyRef": {"name": "p-sampler-keys", "key": "admin-api-key"}}},
                        {"name": "SAMPLER_GATEWAY_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                        # where the pool's other gateways reach it to share /health reads (#53)
                        {"name": "SAMPLER_GATEWAY_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                        # HOME on its writable /tmp, and a user name without a passwd entry (pod_security.py)
                        {"name": "HOME", "value": "/tmp"}, {"name": "USER", "value": "sampler-gateway"},
                        {"name": "LOGNAME", "value": "sampler-gateway"}]
    assert dep["template"]["spec"]["serviceAccountName"] == "p-gateway"
    pod_labels = dep["template"]["metadata"]["labels"]
    assert objs["Service"]["spec"]["selector"] == dep["selector"]["matchLabels"] == pod_labels
    granted = {(r, v, tuple(rule.get("resourceNames", ())))
               for rule in objs["Role"]["rules"] for r in rule["resources"] for v in rule["verbs"]}
    # Reads for discovery; patch on its own pool only (a weights push), never on another pool; its
    # own routing Lease, and list/watch of the others' (a LoRA push waits for their acknowledgement),
    # no delete; Events, create only.
    assert granted == {(r, v, ()) for r in ("samplerreplicas", "samplerpools", "pods")
                       for v in ("get", "list", "watch")} | {("samplerpools", "patch", ("p",))} | {
                           ("leases", v, ()) for v in ("get", "list", "watch", "create", "update")} | {
                           ("events", "create", ())}
    assert "hostNetwork" not in dep["template"]["spec"]
    # Never BestEffort; a slow start is not a dead gateway.
    assert c["resources"] == {"requests": {"cpu": "250m", "memory": "256Mi"}}
    assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] == 120


def test_gateway_on_the_node_network_with_extra_env_and_volumes_keeps_its_key() -> None:
    from sampler_operator.pool.gateway import gateway_objects

    extra = [{"name": "KUBERNETES_SERVICE_HOST", "value": "127.0.0.1"},
             {"name": "SAMPLER_GATEWAY_API_KEY", "value": "tml-not-the-pools"},
             {"name": "SAMPLER_GATEWAY_ADMIN_API_KEY", "value": "tml-not-the-pools-either"}]
    token = {"name": "sa-token", "secret": {"secretName": "p-gateway-token"}}
    mount = {"name": "sa-token", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount", "readOnly": True}
    pool_spec = {"template": TEMPLATE, "gateway": {"hostNetwork": True, "env": extra, "volumes": [token],
                                                   "volumeMounts": [mount]}}
    keys = pool_keys("p", PoolSpec.model_validate(pool_spec))
    [dep] = [o for o in gateway_objects("p", "ns", UID, pool_spec, keys.api, keys.admin) if o["kind"] == "Deployment"]
    pod = dep["spec"]["template"]["spec"]
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    # The pool's keys stay the only ones: an extra named like one is dropped.
    assert pod["containers"][0]["env"] == [
        {"name": "SAMPLER_GATEWAY_API_KEY", "valueFrom": {"secretKeyRef": keys.api.as_dict()}},
        {"name": "SAMPLER_GATEWAY_ADMIN_API_KEY", "valueFrom": {"secretKeyRef": keys.admin.as_dict()}},
        {"name": "SAMPLER_GATEWAY_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "SAMPLER_GATEWAY_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "HOME", "value": "/tmp"}, {"name": "USER", "value": "sampler-gateway"},
        {"name": "LOGNAME", "value": "sampler-gateway"}, extra[0]]
    # the user's volume after the gateway's writable /tmp (pod_security.GATEWAY_WRITABLE)
    assert pod["volumes"] == [{"name": "gateway-tmp", "emptyDir": {}}, token]
    assert pod["containers"][0]["volumeMounts"] == [{"name": "gateway-tmp", "mountPath": "/tmp"}, mount]


def test_a_template_without_keys_gets_one_generated_secret_for_the_whole_pool() -> None:
    s = spec()
    keys = pool_keys("p", s)
    assert keys.generated == ("api-key", "admin-api-key")
    # Every replica names the pool's Secret, so none generates its own (api_keys.replica_keys).
    body = replica_body("p", "ns", UID, s, 1)
    refs = {"apiKeySecretRef": {"name": "p-sampler-keys", "key": "api-key"},
            "adminApiKeySecretRef": {"name": "p-sampler-keys", "key": "admin-api-key"}}
    assert {k: body["spec"][k] for k in refs} == refs
    assert replica_keys("p-1", parse_spec(body["spec"])).generated == ()
    secret = keys_secret("p", "ns", UID, keys, {"api-key": "tml-a", "admin-api-key": "tml-b"})
    assert secret is not None and secret["metadata"]["name"] == "p-sampler-keys"
    assert secret["metadata"]["ownerReferences"][0]["uid"] == UID and secret["stringData"] == {
        "api-key": "tml-a", "admin-api-key": "tml-b"}
    assert {k: v for k, v in pool_status("p", UID, s, [], 1).items() if k in refs} == refs


def test_a_template_with_both_keys_generates_none_and_keeps_them() -> None:
    refs = {"apiKeySecretRef": {"name": "mine", "key": "a"}, "adminApiKeySecretRef": {"name": "mine", "key": "b"}}
    s = PoolSpec.model_validate({"replicas": 1, "template": {**TEMPLATE, **refs}})
    keys = pool_keys("p", s)
    assert keys.generated == () and keys_secret("p", "ns", UID, keys, {}) is None
    assert {k: desired_replica_spec("p", s)[k] for k in refs} == refs
    # Only the admin key named: the api key alone is generated, in the pool's Secret.
    half = PoolSpec.model_validate({"replicas": 1, "template": {**TEMPLATE, "adminApiKeySecretRef": {"name": "mine"}}})
    assert pool_keys("p", half).generated == ("api-key",)
    assert pool_keys("p", half).api.name == "p-sampler-keys" and pool_keys("p", half).admin.name == "mine"


def conds(st: dict[str, Any]) -> dict[str, tuple[str, str, str]]:
    return {c["type"]: (c["status"], c["reason"], c["message"]) for c in st["conditions"]}


def test_conditions_say_available_and_how_far_the_rollout_is() -> None:
    old, new = spec(label="step-1"), spec(label="step-2")
    rolling = [at(new, "p-0"), at(new, "p-1", label="step-1", draining=True), at(old, "p-2")]
    st = pool_status("p", UID, new, rolling, 1, 50.0)
    assert conds(st) == {"Available": ("True", "SomeReplicasReady", "2/3 replicas ready"),
                         "Progressing": ("True", "RollingOut", "1/3 updated to step-2")}
    done = pool_status("p", UID, new, [at(new, f"p-{i}") for i in range(3)], 1, 60.0, st["conditions"])
    assert conds(done) == {"Available": ("True", "AllReplicasReady", "3/3 replicas ready"),
                           "Progressing": ("False", "RolloutComplete", "3/3 updated to step-2")}
    # Available stayed True: its transition time is kept; Progressing changed: a new one.
    times = {c["type"]: c["lastTransitionTime"] for c in done["conditions"]}
    assert times == {"Available": iso(50.0), "Progressing": iso(60.0)}
    none = pool_status("p", UID, new, [at(new, "p-0", phase="Starting")], 1)
    assert conds(none)["Available"][:2] == ("False", "NoReplicaReady")


def rejected(s: PoolSpec, name: str, why: str) -> ReplicaState:
    w = s.weights or {}
    return replace(at(s, name, label="step-1", draining=True), rejected=declared_key(w),
                   rejected_message=why)


def test_a_replica_that_rejects_the_checkpoint_stops_the_rollout_until_the_weights_change() -> None:
    # maxUnavailable 2: p-1 would be in the next batch; after a rejection, no batch is.
    old, bad = spec(label="step-1"), spec(label="step-bad", max_unavailable=2)
    reps = [rejected(bad, "p-0", "model.safetensors: tensor w has shape [2]"), at(old, "p-1"), at(old, "p-2")]
    assert plan("p", UID, bad, reps) == Plan()
    st = pool_status("p", UID, bad, reps, 1)
    assert conds(st)["Progressing"] == (
        "False", "RolloutStopped", "replica p-0 rejected step-bad: model.safetensors: tensor w has shape [2]; "
        "change spec.weights to go on")
    assert [r["state"] for r in st["replicaStatus"]] == ["Rejected", "Outdated", "Outdated"]
    # New weights: the rejected replica (out of routing) gets them at once, the rollout goes on.
    good = spec(label="step-2", max_unavailable=2)
    assert plan("p", UID, good, reps) == Plan(update=["p-0", "p-1"])
    assert conds(pool_status("p", UID, good, reps, 1))["Progressing"][1] == "RollingOut"


def test_the_rejection_is_read_from_the_replica_status() -> None:
    obj: dict[str, Any] = {"metadata": {"name": "p-0"}, "status": {"weights": {
        "declared": {"checkpoint": "/ckpt/x", "versionLabel": "x"}, "declaredResult": "InvalidCheckpoint",
        "declaredMessage": "bad tensor"}}}
    st = ReplicaState.from_object(obj)
    assert (st.rejected, st.rejected_message) == (("/ckpt/x", "x", None), "bad tensor")
    obj["status"]["weights"]["declaredResult"] = "Loaded"
    assert ReplicaState.from_object(obj).rejected is None


def test_rollout_events_tell_each_transition_once() -> None:
    def status(reason: str, message: str = "m") -> dict[str, Any]:
        return {"targetLabel": "step-2", "conditions": [{"type": "Progressing", "reason": reason, "message": message}]}

    assert rollout_events(status("RolloutComplete"), status("RollingOut", "0/3 updated to step-2"), ["p-0"]) == [
        ("Normal", "RolloutStarted", "0/3 updated to step-2"),
        ("Normal", "BatchUpdating", "p-0 out of routing, onto step-2")]
    assert rollout_events(status("RollingOut"), status("RollingOut", "1/3"), []) == []
    assert rollout_events(status("RollingOut"), status("RolloutComplete", "3/3"), []) == [
        ("Normal", "RolloutComplete", "3/3")]
    assert rollout_events(status("RollingOut"), status("RolloutStopped", "p-0 rejected"), []) == [
        ("Warning", "RolloutStopped", "p-0 rejected")]
    assert rollout_events(status("RolloutStopped", "p-0 rejected"), status("RolloutStopped", "p-0 rejected"), []) == []
    assert rollout_events(None, status("RolloutComplete"), []) == []  # a pool created at rest: no story


def test_host_network_replicas_each_get_their_own_port_outside_the_hash() -> None:
    s = spec().model_copy(update={"template": {**TEMPLATE, "hostNetwork": True, "port": 9100}})
    bodies = [replica_body("p", "ns", UID, s, i) for i in range(3)]
    assert [b["spec"]["port"] for b in bodies] == [9100, 9101, 9102]
    # One hash for all: the offset never makes a replica look outdated (plan compares it).
    assert {b["metadata"]["annotations"][ANNOTATION_SPEC_HASH] for b in bodies} == {
        spec_hash(desired_replica_spec("p", s))}
    assert "port" not in replica_spec("p", spec(), 2)  # on the pod network: the template's, one for all


def test_a_replica_not_yet_observed_at_its_new_spec_is_not_verified() -> None:
    """Given a new template, a replica still reports Ready on the pod its controller is about to replace:
    until its controller has observed the new spec it is neither put back in routing nor counted updated
    (the rollout would complete, then start again when the replacement begins)."""
    s = spec(replicas=1, label=None)
    body = replica_body("p", "ns", UID, s, 0)
    body["metadata"]["generation"] = 2
    old = ReplicaState.from_object({**body, "status": {"phase": "Ready", "observedGeneration": 1}})
    assert not old.observed
    assert ReplicaState.from_object({**body, "status": {"phase": "Ready", "observedGeneration": 2}}).observed
    drained = replace(old, draining=True)
    assert plan("p", UID, s, [drained]).undrain == []
    st = pool_status("p", UID, s, [old], 1)
    assert st["updatedReplicas"] == 0 and st["replicaStatus"][0]["state"] == "Updating"
    assert plan("p", UID, s, [replace(drained, observed=True)]).undrain == ["p-0"]


def test_a_drained_replica_goes_back_in_routing_on_its_pods_load_answer() -> None:
    """Drain and Abort take replicas out in batches: each one goes back in routing as soon as its
    pod answers the load made under its current spec (told in-process, LoadAnswer), not one status
    write and one watch event later; the next batch goes out in the same step. The pool's status
    still counts it updated only once its own status says so."""
    old, new = spec(label="step-1"), spec(label="step-2")
    # p-0 was given the new spec (generation 2) and drained; its controller has not written a status since.
    loading = replace(at(new, "p-0", label="step-1", draining=True), observed=False, generation=2)
    replicas = [loading, at(old, "p-1"), at(old, "p-2")]
    assert plan("p", UID, new, replicas) == Plan()
    answered = {"p-0": LoadAnswer("step-2", 2, "step-1")}
    assert plan("p", UID, new, replicas, loaded=answered) == Plan(update=["p-1"], undrain=["p-0"])
    st = pool_status("p", UID, new, replicas, 1)
    assert st["updatedReplicas"] == 0 and st["replicaStatus"][0]["state"] == "Updating"
    # An answer that is not the target's, or was made under an older spec (the pool wrote another
    # since: a template change replaces the pod), or a replica not Ready: no.
    for stale in (LoadAnswer("step-3", 2, "step-1"), LoadAnswer("step-2", 1, "step-1"), LoadAnswer("step-2", None)):
        assert plan("p", UID, new, replicas, loaded={"p-0": stale}) == Plan()
    starting = [replace(loading, phase="Starting"), *replicas[1:]]
    assert plan("p", UID, new, starting, loaded=answered) == Plan()
    # An operator restarted after putting p-0 back in routing on the answer has forgotten it: p-0 is
    # in routing and unverified, so it uses the budget until its status says step-2 (no second batch).
    back = [replace(loading, draining=False), *replicas[1:]]
    assert plan("p", UID, new, back) == Plan()
    assert plan("p", UID, new, back, loaded=answered) == Plan(update=["p-1"])
