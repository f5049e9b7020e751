"""Issue #31 on the OpenAI routes: `model` names a run's adapter (`<run>`, `<run>@<step>`), through
a real gateway process in front of stand-in replicas with LoRA (tests/support/openai_stub.py: they
load and unload adapters by name and answer vLLM's 404 for a `model` they do not hold). The pool's
adapters come from `--adapters-file` (static discovery's stand-in for `spec.adapters`)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.gateway import RunningGateway, run_gateway
from tests.support.metrics import metric
from tests.support.openai_stub import StubPool, stub_replicas

KEY = "k-openai-lora"
AUTH = {"Authorization": f"Bearer {KEY}"}
SPEC = {"serial": 4, "runs": {
    "a": {"versions": [{"label": "step-1", "step": 1, "path": "/ckpt/a/1", "serial": 1},
                       {"label": "step-2", "step": 2, "path": "/ckpt/a/2", "serial": 2}]},
    "b": {"versions": [{"label": "step-1", "step": 1, "path": "/ckpt/b/1", "serial": 3},
                       {"label": "step-5", "step": 5, "path": "/ckpt/b/5", "serial": 4}]}}}


@pytest.fixture
def stubs() -> Iterator[StubPool]:
    with stub_replicas({"r0": "step-1", "r1": "step-1"}) as pool:
        yield pool


@pytest.fixture
def gw(stubs: StubPool, tmp_path: Path) -> Iterator[RunningGateway]:
    path = tmp_path / "adapters.json"
    path.write_text(json.dumps(SPEC))
    with run_gateway(stubs.urls, "--api-key", KEY, "--adapters-file", str(path), "--lora-slots", "1",
                     "--refresh-interval-s", "60") as g:
        g.wait_eligible({"r0", "r1"})
        yield g


def sdk(gw: RunningGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0)


def test_models_lists_the_base_model_each_run_and_each_version(gw: RunningGateway) -> None:
    cards = sdk(gw).models.list().data
    assert [m.id for m in cards] == ["tiny", "a", "a@1", "a@2", "b", "b@1", "b@5"]
    by_id = {m.id: m for m in cards}
    # vLLM's ModelCard for a LoRA adapter: the base model's card, its own id, root its path, parent the base.
    assert by_id["a"].model_extra == {**by_id["tiny"].model_extra, "root": "/ckpt/a/2", "parent": "tiny"}
    assert by_id["b@1"].model_extra is not None and by_id["b@1"].model_extra["root"] == "/ckpt/b/1"


def test_model_selects_exactly_its_version_and_the_answer_names_it(gw: RunningGateway, stubs: StubPool) -> None:
    client = sdk(gw)
    for name, engine, version in [("a", "a.2.2", "a@2"), ("a@1", "a.1.1", "a@1"), ("b", "b.5.4", "b@5"),
                                  ("b@1", "b.1.3", "b@1")]:
        raw = client.completions.with_raw_response.create(model=name, prompt=[1, 2], max_tokens=3)
        assert raw.headers["x-sampler-adapter"] == version, name
        seen = stubs.requests("/v1/completions")[-1]
        assert json.loads(seen.body)["model"] == engine and seen.replica == raw.headers["x-sampler-replica"]
        # The replica that answered holds it (loaded there on demand) and, with one slot, nothing else.
        assert stubs.adapters[seen.replica] == {engine: SPEC["runs"][name[0]]["versions"][
            0 if engine.split(".")[1] == "1" else 1]["path"]}
    # The base model's name: the body goes as sent, byte for byte.
    body = b'{"model": "tiny",  "prompt": [5, 6]}'
    r = httpx.post(gw.url + "/v1/completions", content=body, headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 200 and stubs.requests("/v1/completions")[-1].body == body
    assert "x-sampler-adapter" not in r.headers


def test_a_name_the_pool_does_not_declare_is_404_naming_model(gw: RunningGateway, stubs: StubPool) -> None:
    before = len(stubs.requests("/v1/completions"))
    for name in ("nope", "a@3", "a.2.2"):
        with pytest.raises(openai.NotFoundError) as e:
            sdk(gw).completions.create(model=name, prompt=[1], max_tokens=2)
        assert e.value.body is not None and e.value.body["param"] == "model", name  # type: ignore[index]
    for path in ("/v1/chat/completions", "/inference/v1/generate"):
        r = httpx.post(gw.url + path, json={"model": "nope", "messages": []}, headers=AUTH)
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert len(stubs.requests("/v1/completions")) == before  # no replica ever saw them


def test_a_stream_for_a_version_is_relayed_and_its_count_ends_with_it(gw: RunningGateway, stubs: StubPool) -> None:
    chunks = list(sdk(gw).completions.create(model="b@1", prompt=[1], max_tokens=3, stream=True))
    assert [c.choices[0].text for c in chunks][:3] == ["t0", "t1", "t2"]
    assert json.loads(stubs.requests("/v1/completions")[-1].body)["model"] == "b.1.3"
    gw.wait(lambda h: all(r["in_flight"] == 0 for r in h["replicas"]), "no request in flight")
    # The stream's version is no longer in flight: another version may take its slot on that replica.
    for name in ("a@1", "a@2", "b@5", "b@1"):
        sdk(gw).completions.create(model=name, prompt=[1], max_tokens=2)


def test_a_replica_that_no_longer_holds_the_version_is_not_the_answer(gw: RunningGateway, stubs: StubPool) -> None:
    """Unloaded behind the gateway's back (its /health is read once a minute here): the replica's 404
    for `model` is not passed on; the request is placed again, the version loaded again."""
    raw = sdk(gw).completions.with_raw_response.create(model="a@1", prompt=[1], max_tokens=2)
    holder = raw.headers["x-sampler-replica"]
    del stubs.adapters[holder]["a.1.1"]
    raw = sdk(gw).completions.with_raw_response.create(model="a@1", prompt=[1], max_tokens=2)
    assert raw.headers["x-sampler-adapter"] == "a@1"
    assert "a.1.1" in stubs.adapters[raw.headers["x-sampler-replica"]]
    assert metric(gw.metrics(), "sampler_gateway_adapter_replaced_total", 0.0, replica=holder) == 1.0


def test_an_unload_the_replica_refuses_is_placed_again_and_nothing_is_unloaded(stubs: StubPool,
                                                                              tmp_path: Path) -> None:
    """The replica answers 409 to an unload (requests in flight on that version there that this
    gateway does not count: another gateway's): the request is placed again elsewhere, and with
    nowhere else to go it is a 503 naming the refusal; the version stays loaded."""
    path = tmp_path / "adapters.json"
    path.write_text(json.dumps(SPEC))
    with run_gateway({"r0": stubs.urls["r0"]}, "--api-key", KEY, "--adapters-file", str(path), "--lora-slots", "1",
                     "--refresh-interval-s", "60") as gw:
        gw.wait_eligible({"r0"})
        sdk(gw).completions.create(model="a@1", prompt=[1], max_tokens=2)
        assert set(stubs.adapters["r0"]) == {"a.1.1"}
        stubs.busy.add("a.1.1")
        r = httpx.post(gw.url + "/v1/completions", json={"model": "b@1", "prompt": [1]}, headers=AUTH)
        assert r.status_code == 503 and "refused to make room" in r.json()["error"]["message"], r.text
        assert set(stubs.adapters["r0"]) == {"a.1.1"}
        assert metric(gw.metrics(), "sampler_gateway_adapter_unloads_total", 0.0, replica="r0",
                      outcome="in_flight") == 1.0
        stubs.busy.clear()
        raw = sdk(gw).completions.with_raw_response.create(model="b@1", prompt=[1], max_tokens=2)
        assert raw.headers["x-sampler-adapter"] == "b@1" and set(stubs.adapters["r0"]) == {"b.1.3"}


def test_a_refused_unload_is_placed_on_another_replica(gw: RunningGateway, stubs: StubPool) -> None:
    # One version on each replica, both busy at the replicas but idle for this gateway.
    sdk(gw).completions.create(model="a@1", prompt=[1], max_tokens=2)
    sdk(gw).completions.create(model="b@1", prompt=[1], max_tokens=2)
    assert sorted(n for held in stubs.adapters.values() for n in held) == ["a.1.1", "b.1.3"]
    first = next(r for r, held in stubs.adapters.items() if "a.1.1" in held)
    stubs.busy.add("a.1.1")
    stubs.busy.add("b.1.3")
    r = httpx.post(gw.url + "/v1/completions", json={"model": "a@2", "prompt": [1]}, headers=AUTH)
    # Both refused (once each at most): a 503; nothing unloaded.
    assert r.status_code == 503, r.text
    assert sorted(n for held in stubs.adapters.values() for n in held) == ["a.1.1", "b.1.3"]
    stubs.busy.discard("b.1.3")
    # Now one replica refuses and the other does not: whichever is tried first, a@2 lands where b.1.3 was.
    raw = sdk(gw).completions.with_raw_response.create(model="a@2", prompt=[1], max_tokens=2)
    assert raw.headers["x-sampler-adapter"] == "a@2" and raw.headers["x-sampler-replica"] != first
    assert stubs.adapters[first] == {"a.1.1": "/ckpt/a/1"}


def test_a_replica_full_beyond_what_the_gateway_knew_places_the_request_elsewhere(gw: RunningGateway,
                                                                                  stubs: StubPool) -> None:
    """Each replica holds one adapter at most (the gateway counts one slot too): a version loaded
    behind the gateway's back fills r's only slot; the add there is a 409 (full), and the request
    goes to the other replica, never over a replica's capacity."""
    stubs.capacity = 1
    for name in ("a@1", "b@1"):
        sdk(gw).completions.create(model=name, prompt=[1], max_tokens=2)
    # Fill each replica behind the gateway's back: its /health (read once a minute here) does not say so.
    for replica in stubs.adapters:
        stubs.adapters[replica] = {"x.1.99": "/elsewhere"}
    r = httpx.post(gw.url + "/v1/completions", json={"model": "a@2", "prompt": [1]}, headers=AUTH)
    assert r.status_code == 503 and "refused" in r.json()["error"]["message"], r.text
    assert all(len(held) == 1 for held in stubs.adapters.values())
    full = sum(metric(gw.metrics(), "sampler_gateway_adapter_loads_total", 0.0, replica=n, outcome="full")
               for n in ("r0", "r1"))
    assert full == 2.0  # each replica tried once
    stubs.adapters["r1"] = {}
    raw = sdk(gw).completions.with_raw_response.create(model="a@2", prompt=[1], max_tokens=2)
    assert raw.headers["x-sampler-replica"] == "r1" and stubs.adapters["r1"] == {"a.2.2": "/ckpt/a/2"}
