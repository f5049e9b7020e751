"""The gateway's pure decisions: the picker, the version policy, the id codec, the pool's choice
(with its in-flight counts, lost replicas and label order), Kubernetes members, the config."""

from __future__ import annotations

import collections
from typing import Any

import pytest

from sampler_gateway.config import GatewayConfig, parse_config
from sampler_gateway.discovery.kube import members_of
from sampler_gateway.errors import NoReplica
from sampler_gateway.metrics.registry import GatewayMetrics
from sampler_gateway.replicas import ids
from sampler_gateway.replicas.view import Member, PoolView, ReplicaView
from sampler_gateway.routing.picker import pick, preferred
from sampler_gateway.routing.pool import Pool
from sampler_gateway.routing.versions import LabelOrder, is_stale, version_filter


def name_of(r: ReplicaView | None) -> str | None:
    return None if r is None else r.name


def rv(name: str, label: str | None = "step-1", version: int | None = 1, ready: bool = True,
       draining: bool = False) -> ReplicaView:
    return ReplicaView(name, f"http://{name}", ready, draining, label, version)


# ---------------------------------------------------------------------------- picker


def test_least_loaded_wins_and_ties_rotate() -> None:
    rs = [rv("a"), rv("b"), rv("c")]
    assert name_of(pick(rs, {"a": 2, "b": 0, "c": 1}, capacity=10)) == "b"
    # Idle pool: sequential requests spread over every replica instead of piling on the first.
    assert [name_of(pick(rs, {}, capacity=10, turn=t)) for t in range(6)] == ["a", "b", "c", "a", "b", "c"]
    assert pick([], {}, capacity=10) is None


def test_affinity_is_sticky_spills_at_capacity_and_moves_only_the_leavers_keys() -> None:
    rs = [rv(n) for n in "abcd"]
    keys = [f"group-{i}" for i in range(400)]
    home = {k: preferred(k, rs).name for k in keys}
    # Spread: every replica is some keys' home.
    assert set(collections.Counter(home.values())) == set("abcd")
    for k in keys[:20]:
        assert name_of(pick(rs, {}, affinity=k, capacity=2)) == home[k]
    # At capacity the key spills to the least loaded replica.
    k = keys[0]
    full = {home[k]: 2}
    spilled = pick(rs, full, affinity=k, capacity=2)
    assert spilled is not None and spilled.name != home[k]
    # Rendezvous: when "d" leaves, only the keys that lived on "d" move.
    without_d = [r for r in rs if r.name != "d"]
    moved = [k for k in keys if preferred(k, without_d).name != home[k]]
    assert moved and all(home[k] == "d" for k in moved)


# ---------------------------------------------------------------------------- versions


def order(*labels: str) -> LabelOrder:
    o = LabelOrder()
    for lbl in labels:
        o.see([(lbl, None)])
    return o


def test_latest_routes_only_to_the_newest_label_and_never_back() -> None:
    o = order("step-1", "step-2")
    old, new = rv("a", "step-1"), rv("b", "step-2")
    assert version_filter([old, new], "Latest", o, None, None) == ([new], [old])
    # Only old replicas left: still allowed while nothing newer was returned ...
    assert version_filter([old], "Latest", o, None, None) == ([old], [])
    # ... but once step-2 went back to a client, never step-1 again: capacity dips instead.
    o.note_returned("step-2", None)
    assert version_filter([old], "Latest", o, None, None) == ([], [old])
    assert is_stale("step-1", "Latest", o, None) and not is_stale("step-2", "Latest", o, None)


def test_latest_with_a_target_label() -> None:
    o = order("step-3", "step-2")  # first seen order does not matter: the target is newest
    a, b = rv("a", "step-3"), rv("b", "step-2")
    assert version_filter([a, b], "Latest", o, "step-2", None) == ([b], [a])
    # No replica serves the target yet: the newest label served is used meanwhile.
    c = rv("c", "step-1")
    o.see([("step-1", None)])
    assert version_filter([a, c], "Latest", o, "step-4", None) == ([c], [a])


def test_labels_first_seen_together_rank_by_version() -> None:
    o = LabelOrder()
    o.see([("step-9", 4), ("step-10", 5)])
    assert version_filter([rv("a", "step-9", 4), rv("b", "step-10", 5)], "Latest", o, None, None)[0] == [
        rv("b", "step-10", 5)]


def test_min_version_and_any() -> None:
    o = order("step-1", "step-2", "step-3")
    rs = [rv("a", "step-1"), rv("b", "step-2"), rv("c", "step-3")]
    assert version_filter(rs, "MinVersion", o, None, "step-2") == (rs[1:], rs[:1])
    assert version_filter(rs, "MinVersion", o, None, None) == (rs, [])  # no floor: like Any
    assert version_filter(rs, "Any", o, None, None) == (rs, [])
    o.note_returned("step-3", None)
    assert not is_stale("step-1", "MinVersion", o, None) and not is_stale("step-1", "Any", o, None)


# ---------------------------------------------------------------------------- ids


def test_id_codec_roundtrip_and_validation() -> None:
    routed = ids.encode("policy-0.pool", "0f3a~x:1")
    assert routed == "policy-0.pool~0f3a~x:1"
    assert ids.decode(routed) == ids.RoutedId("policy-0.pool", "0f3a~x:1")
    for bad in ["", "abc", "~abc", "Policy~x", "r0~", "-r~x", "r0~" + "x" * 201, "r_0~x"]:
        assert ids.decode(bad) is None, bad
    for name, inner in [("Bad", "x"), ("r0", ""), ("r0", "x" * 201)]:
        with pytest.raises(ValueError):
            ids.encode(name, inner)


def test_a_future_for_a_runs_newest_version_carries_the_run() -> None:
    routed = ids.encode("policy-0.pool", "0f3a~x:1", run="Math_2")
    assert routed == "policy-0.pool+Math_2~0f3a~x:1"
    assert ids.decode(routed) == ids.RoutedId("policy-0.pool", "0f3a~x:1", "Math_2")
    assert ids.decode("policy-0.pool~0f3a") == ids.RoutedId("policy-0.pool", "0f3a")  # no run: as before
    for bad in ["r0+~x", "r0+a.b~x", "r0+a+b~x", "+a~x", "r0+" + "a" * 64 + "~x"]:
        assert ids.decode(bad) is None, bad
    with pytest.raises(ValueError):
        ids.encode("r0", "x", run="a.1")


# ---------------------------------------------------------------------------- the pool's choice


def cfg(**kw: object) -> GatewayConfig:
    return GatewayConfig.model_validate({"pool": "p", "discovery": "static", "replicas": ["a=http://a"], **kw})


def test_pool_leaves_out_unready_draining_and_lost_until_a_later_refresh() -> None:
    now = [10.0]
    pool = Pool(cfg(), GatewayMetrics(), clock=lambda: now[0])
    a, b, c = rv("a"), rv("b", draining=True), rv("c", ready=False)
    pool.update(PoolView((a, b, c), started_at=9.0))
    assert [pool.choose().name for _ in range(3)] == ["a"] * 3
    pool.mark_lost(a, "connection refused")
    with pytest.raises(NoReplica) as e:
        pool.choose()
    assert "a: lost (connection refused)" in e.value.message and "b: draining" in e.value.message
    assert e.value.headers["Retry-After"] == "1"
    pool.update(PoolView((a, b, c), started_at=9.5))  # a refresh that started before the loss
    with pytest.raises(NoReplica):
        pool.choose()
    pool.update(PoolView((a, b, c), started_at=10.5))
    assert pool.choose().name == "a"
    # The owner of a future is found whatever its state; a replica gone from the view is not.
    assert pool.owner("c") == c and pool.owner("zz") is None


def test_pool_counts_in_flight_and_prefers_the_sessions_replica() -> None:
    pool = Pool(cfg(), GatewayMetrics())
    pool.update(PoolView((rv("a"), rv("b"))))
    with pool.lease(rv("a"), "new"):
        assert pool.choose().name == "b"
        assert pool.choose(prefer="a").name == "a"
    assert pool.in_flight == {"a": 0}
    with pytest.raises(NoReplica, match="serves 'step-1', not 'step-2'"):
        pool.choose(label="step-2")


def test_pool_refuses_a_stale_answer_under_latest() -> None:
    pool = Pool(cfg(), GatewayMetrics())
    a, b = rv("a", "step-1"), rv("b", "step-1")
    pool.update(PoolView((a, b)))
    assert pool.returned(a, "step-1")
    b2 = rv("b", "step-2", 2)
    pool.update(PoolView((a, b2)))
    assert pool.choose().name == "b"  # the newest label as soon as one replica serves it
    assert pool.returned(b2, "step-2")
    assert not pool.returned(a, "step-1")
    # A label first met in a response (before any /health showed it) is newer than all seen.
    assert pool.returned(a, "step-3") and pool.order.newest_returned == "step-3"


# ---------------------------------------------------------------------------- kubernetes members


def cr(name: str, pod: str | None, port: int = 8000, draining: bool = False, pool: str = "gp",
       by_label: bool = False) -> dict[str, Any]:
    ann = {"sampler.rl.dev/draining": "true"} if draining else {}
    labels = {"sampler.rl.dev/pool": pool} if by_label else {}
    spec = {"port": port} if by_label else {"port": port, "pool": pool}
    return {"metadata": {"name": name, "annotations": ann, "labels": labels}, "spec": spec, "status": {"podName": pod}}


def pod(name: str, replica: str, ip: str | None, terminating: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": {"sampler.rl.dev/replica": replica}}
    if terminating:
        meta["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    return {"metadata": meta, "status": {"podIP": ip}}


def test_members_from_replicas_and_pods() -> None:
    replicas = [cr("r1", "r1-3", port=9000, draining=True, by_label=True), cr("r0", "r0-1"), cr("r2", "r2-1"),
                cr("r3", None), cr("r4", "r4-2"), cr("x0", "x0-1", pool="other")]
    pods = [pod("r0-1", "r0", "10.0.0.5"), pod("r1-3", "r1", "10.0.0.6"), pod("r2-1", "r2", None),
            pod("r4-2", "r4", "10.0.0.7", terminating=True), pod("r4-1", "r4", "10.0.0.8"),
            pod("x0-1", "x0", "10.0.0.9")]
    assert members_of("gp", replicas, pods) == (
        Member("r0", "http://10.0.0.5:8000"), Member("r1", "http://10.0.0.6:9000", draining=True),
        Member("r4", "http://10.0.0.7:8000", draining=True))


# ---------------------------------------------------------------------------- config


def test_config_flags_env_and_refusals(capsys: pytest.CaptureFixture[str]) -> None:
    c = parse_config(["--pool", "p", "--discovery", "static", "--replica", "r0=http://127.0.0.1:1",
                      "--replica", "r1=http://127.0.0.1:2/"], environ={"SAMPLER_GATEWAY_VERSION_POLICY": "Any"})
    assert c.static_members() == [("r0", "http://127.0.0.1:1"), ("r1", "http://127.0.0.1:2")]
    assert c.version_policy == "Any" and c.refresh_interval_s == 0.5
    env = parse_config([], environ={"SAMPLER_GATEWAY_POOL": "p", "SAMPLER_GATEWAY_DISCOVERY": "static",
                                    "SAMPLER_GATEWAY_REPLICAS": "a=http://x:1,b=http://y:2"})
    assert [n for n, _ in env.static_members()] == ["a", "b"]
    for argv, needle in [(["--pool", "p", "--discovery", "static"], "needs --replica"),
                         (["--pool", "p", "--refresh-interval-s", "61"], "--refresh-interval-s"),
                         (["--pool", "p", "--discovery", "static", "--replica", "r0"], "NAME=http"),
                         (["--pool", "p", "--version-policy", "Newest"], "--version-policy")]:
        with pytest.raises(SystemExit):
            parse_config(argv, environ={})
        assert needle in capsys.readouterr().err


def test_target_label_from_the_samplerpool() -> None:
    from sampler_gateway.discovery.kube import target_of

    assert target_of([]) is None
    assert target_of([{"spec": {"replicas": 2}}]) is None
    assert target_of([{"spec": {"weights": {"checkpoint": "/c", "versionLabel": "step-3"}}}]) == "step-3"
