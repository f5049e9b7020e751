"""The pure parts of routing by adapter: a replica's `/health` read with its defaults
(adapter_health.py), what placement reads of each replica (lora.router.placement_inputs), a
replica's "unknown adapter" answer, the names Tinker and a sampling session carry, and the declared
adapters read from the pool object or the static stand-in file."""

from __future__ import annotations

import base64
import datetime as dt
import json
from pathlib import Path

import orjson
import pytest

from sampler_common.adapters import AdapterState, adapter_state
from sampler_common.errors import NotFound
from sampler_gateway.config import GatewayConfig
from sampler_gateway.discovery.kube import adapters_of
from sampler_gateway.discovery.static import StaticDiscovery
from sampler_gateway.lora.router import AdapterRouter, placement_inputs, unknown_adapter
from sampler_gateway.metrics.registry import GatewayMetrics
from sampler_gateway.replicas.adapter_health import HeldAdapter, ReplicaLora, lora_of
from sampler_gateway.replicas.view import PoolView, ReplicaView
from sampler_gateway.routes.tinker import session_model_path
from sampler_gateway.routing.pool import Pool
from sampler_gateway.upstream.exchange import Reply

SPEC = {"serial": 3, "runs": {"a": {"versions": [{"label": "s1", "step": 1, "path": "/c/a1", "serial": 1},
                                                 {"label": "s2", "step": 2, "path": "/c/a2", "serial": 2}]}}}


# ---------------------------------------------------------------- /health, with defaults

def test_health_of_a_sampler_that_reports_everything() -> None:
    at = "2026-12-03T19:00:00.5Z"
    lora = lora_of({"lora_slots": 8, "max_loras": 2, "adapters": [
        {"name": "a.1.1", "path": "/c", "in_flight": 3, "last_used_at": at},
        {"name": "a.2.2", "path": "/c", "in_flight": 0, "last_used_at": None}]})
    when = dt.datetime(2026, 12, 3, 19, 0, 0, 500000, tzinfo=dt.UTC).timestamp()
    assert lora == ReplicaLora(8, (HeldAdapter("a.1.1", 3, when), HeldAdapter("a.2.2", 0, None)))


@pytest.mark.parametrize(("health", "slots"), [
    ({"adapters": []}, None),                    # an older sampler: the gateway's --lora-slots decides
    ({"max_loras": 2, "adapters": []}, 2),       # its max_loras: what vLLM holds without max_cpu_loras
    ({"lora_slots": 0, "max_loras": 4}, 0),      # LoRA off
    ({"lora_slots": "8", "max_loras": True}, None),  # not integers: unknown
])
def test_slots_default_to_max_loras_then_unknown(health: dict[str, object], slots: int | None) -> None:
    assert lora_of(health).slots == slots


def test_an_older_samplers_adapter_list_and_bad_entries() -> None:
    lora = lora_of({"adapters": [{"name": "a.1.1", "path": "/c"}, {"path": "/x"}, "junk", {"name": ""},
                                 {"name": "b.1.2", "in_flight": -1, "last_used_at": "yesterday"}]})
    assert lora.adapters == (HeldAdapter("a.1.1"), HeldAdapter("b.1.2"))
    assert lora_of({"adapters": None}) == lora_of({}) == ReplicaLora(None)


# ---------------------------------------------------------------- placement's inputs

def view(name: str, slots: int | None, *held: HeldAdapter) -> ReplicaView:
    return ReplicaView(name, "http://127.0.0.1:1", True, False, "base", 0, lora=ReplicaLora(slots, held))


def test_placement_inputs_put_the_gateways_news_on_the_replicas_last_health() -> None:
    r0 = view("r0", None, HeldAdapter("a.1.1", in_flight=1, last_used_at=50.0), HeldAdapter("a.2.2", 0, 10.0))
    r1 = view("r1", 3, HeldAdapter("b.1.3", in_flight=5, last_used_at=20.0))
    out = placement_inputs(
        [r0, r1], default_slots=4, load={"r0": 7},
        in_flight={("r0", "a.1.1"): 4, ("r1", "b.1.3"): 2, ("r0", "c.1.4"): 1},
        last_used={("r0", "a.2.2"): 99.0, ("r0", "c.1.4"): 100.0},
        loading={("r0", "c.1.4")}, unloading={("r1", "b.1.3")})
    a, b = out
    # Unknown slots: the gateway's default. In flight: the higher of the two counts. Last use: the later.
    # A version loading for a request is held there (and in flight); one being unloaded is held nowhere.
    assert (a.name, a.slots, a.load) == ("r0", 4, 7)
    assert dict(a.loaded) == {"a.1.1": 50.0, "a.2.2": 99.0, "c.1.4": 100.0}
    assert dict(a.in_flight) == {"a.1.1": 4, "c.1.4": 1}
    assert (b.name, b.slots, b.load, dict(b.loaded), dict(b.in_flight)) == ("r1", 3, 0, {}, {})


def read_at(t: float, name: str, *held: HeldAdapter) -> ReplicaView:
    return ReplicaView(name, "http://127.0.0.1:1", True, False, "base", 0, lora=ReplicaLora(2, held, read_at=t))


def test_a_request_ended_after_the_read_began_is_not_counted_again_as_another_gateways() -> None:
    """The read began at t=10 while this gateway's one request on a.1.1 ran; it ended at t=11; the read
    landed after. The replica's 1 is that request: the version is idle now, not busy until the next
    read (a closed loop's just-used version was unloaded instead of this idle one)."""
    r0 = read_at(10.0, "r0", HeldAdapter("a.1.1", in_flight=1), HeldAdapter("b.1.2", in_flight=0))
    common = dict(default_slots=2, load={}, last_used={}, loading=(), unloading=())
    [idle] = placement_inputs([r0], in_flight={}, ended={("r0", "a.1.1"): [4.0, 11.0]}, **common)
    assert dict(idle.in_flight) == {}
    # Ended before the read began: the replica's 1 is another gateway's (or a future), kept busy.
    [busy] = placement_inputs([r0], in_flight={}, ended={("r0", "a.1.1"): [4.0, 9.0]}, **common)
    assert dict(busy.in_flight) == {"a.1.1": 1}
    # Ours in flight now (since before the read) and 3 counted: 2 are the others', on top of our 1.
    r1 = read_at(10.0, "r1", HeldAdapter("a.1.1", in_flight=3))
    [mixed] = placement_inputs([r1], in_flight={("r1", "a.1.1"): 1}, ended={}, **common)
    assert dict(mixed.in_flight) == {"a.1.1": 3}
    # A read of unknown start (none said): the larger of the two counts, as without `ended`.
    [unknown] = placement_inputs([view("r2", 2, HeldAdapter("a.1.1", in_flight=1))], in_flight={},
                                 ended={("r2", "a.1.1"): [11.0]}, **common)
    assert dict(unknown.in_flight) == {"a.1.1": 1}


def test_a_read_says_when_it_began_and_two_reads_of_the_same_compare_equal() -> None:
    body = {"lora_slots": 2, "adapters": [{"name": "a.1.1", "in_flight": 1}]}
    assert lora_of(body, 5.0).read_at == 5.0 and lora_of(body).read_at is None
    assert lora_of(body, 5.0) == lora_of(body, 6.0)   # what the replica holds, not when it was read


def reply(status: int, body: object) -> Reply:
    return Reply(status, (("content-type", "application/json"),), orjson.dumps(body))


def test_unknown_adapter_is_a_4xx_naming_the_field_or_vllms_404_for_model() -> None:
    native = reply(400, {"error": {"category": "invalid_request", "message": "unknown adapter", "field": "adapter"}})
    assert unknown_adapter(native, "adapter") and not unknown_adapter(native, "model_path")
    vllm = reply(404, {"error": {"message": "The model `a.1.1` does not exist.", "type": "NotFoundError",
                                 "param": None, "code": 404}})
    assert unknown_adapter(vllm, "model") and not unknown_adapter(vllm, "adapter")
    assert not unknown_adapter(reply(400, {"error": {"message": "bad", "field": "prompts[0]"}}), "adapter")
    assert not unknown_adapter(reply(200, {"error": {"field": "adapter"}}), "adapter")
    assert not unknown_adapter(reply(429, {"error": {"field": "adapter"}}), "adapter")
    assert not unknown_adapter(reply(404, {"error": "tinker's flat shape", "category": "user"}), "model_path")


# ---------------------------------------------------------------- names

def router(state: AdapterState | None) -> AdapterRouter:
    cfg = GatewayConfig(pool="p", discovery="static", replicas=["r0=http://127.0.0.1:1"])
    pool = Pool(cfg, GatewayMetrics())
    pool.view = PoolView((view("r0", 2),), adapters=state)
    return AdapterRouter(cfg, pool, upstream=None, metrics=pool.metrics)  # type: ignore[arg-type]


def test_tinker_paths_name_a_declared_version_or_are_left_to_the_replica() -> None:
    rt = router(adapter_state({"spec": {"adapters": SPEC}}))
    t = rt.resolve_tinker("tinker://a/sampler_weights/s1")
    assert t is not None and (t.engine_name, t.pinned) == ("a.1.1", True)
    t = rt.resolve_tinker("tinker://a.2.2")  # what a session created through the gateway carries
    assert t is not None and (t.engine_name, t.pinned) == ("a.2.2", True)
    with pytest.raises(NotFound) as e:
        rt.resolve_tinker("tinker://a/sampler_weights/s9")
    assert e.value.field == "model_path"
    # Not a pool adapter: a full-weights label pinned, another run's path, not a tinker path.
    for other in ("tinker://step-7", "tinker://zz/sampler_weights/s1", "tinker://a.9.9", "a@1"):
        assert rt.resolve_tinker(other) is None, other


def test_a_sampling_session_id_carries_its_model_path() -> None:
    def sid(ref: dict[str, object]) -> str:
        return "ss-" + base64.urlsafe_b64encode(json.dumps(ref).encode()).decode().rstrip("=")

    assert session_model_path(sid({"s": "x", "n": 1, "m": "tinker://a.1.1"})) == "tinker://a.1.1"
    assert session_model_path(sid({"s": "x", "n": 1, "b": "tiny"})) is None
    for bad in ("ss-!!!", "nope", None, 7, sid({"m": 3}), "ss-" + base64.urlsafe_b64encode(b"[1]").decode()):
        assert session_model_path(bad) is None


def test_names_resolve_against_the_replicas_base_model_and_the_declared_runs() -> None:
    rt = router(adapter_state({"spec": {"adapters": SPEC}}))
    rt.pool.view = PoolView((ReplicaView("r0", "u", True, False, "base", 0, model="/models/Tiny-Llama"),),
                            adapters=rt.pool.view.adapters)
    assert type(rt.resolve("tiny-llama", "model")).__name__ == "BaseTarget"
    t = rt.resolve("a", "model")
    assert type(t).__name__ == "VersionTarget" and t.engine_name == "a.2.2"  # type: ignore[union-attr]
    with pytest.raises(NotFound) as e:
        router(None).resolve("a", "adapter")
    assert e.value.field == "adapter" and "declares no adapter" in e.value.message


# ---------------------------------------------------------------- where the declared adapters come from

def test_kube_reads_spec_adapters_and_keeps_the_last_good_state_past_a_bad_edit() -> None:
    good = {"metadata": {"name": "p"}, "spec": {"adapters": SPEC}}
    state = adapters_of([good], None)
    assert state is not None and sorted(state.engine_names()) == ["a.1.1", "a.2.2"]
    twice = [{"label": "s1", "step": 1, "path": "/c", "serial": 1},
             {"label": "s2", "step": 1, "path": "/c", "serial": 2}]
    bad = {"metadata": {"name": "p"}, "spec": {"adapters": {"runs": {"a": {"versions": twice}}}}}
    assert adapters_of([bad], state) is state
    assert adapters_of([], state) is None  # no pool object: nothing declared
    assert adapters_of([{"metadata": {"name": "p"}, "spec": {}}], state) == AdapterState()


async def test_static_adapters_file_is_read_and_reread_when_it_changes(tmp_path: Path) -> None:
    path = tmp_path / "adapters.json"
    path.write_text(json.dumps(SPEC))
    source = StaticDiscovery([("r0", "http://127.0.0.1:1")], None, path)
    first = (await source.membership()).adapters
    assert first is not None and sorted(first.engine_names()) == ["a.1.1", "a.2.2"]
    path.write_text("{not json")
    await source.changed()  # the rewrite is a change
    assert (await source.membership()).adapters == first  # a broken file: the last good state
    bigger = {**SPEC, "runs": {**SPEC["runs"], "b": {"versions": [  # type: ignore[dict-item]
        {"label": "s1", "step": 1, "path": "/c", "serial": 7}]}}}
    tmp = tmp_path / "a.tmp"
    tmp.write_text(json.dumps(bigger))
    tmp.replace(path)
    await source.changed()
    now = (await source.membership()).adapters
    assert now is not None and sorted(now.runs) == ["a", "b"]
