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

from tests.support.gateway import RunningGateway, run_gateway, write_replicas
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


# A request's own bound when it waits for a slot, in the tests of refused unloads: the OpenAI routes
# name no timeout, so the gateway's --request-timeout-s bounds the wait (lora/router.py).
SLOT_BOUND_S = 3.0


def refused_unloads(gw: RunningGateway, replica: str) -> float:
    return metric(gw.metrics(), "sampler_gateway_adapter_unloads_total", 0.0, replica=replica, outcome="in_flight")


def test_an_unload_the_replica_refuses_waits_within_its_bound_and_nothing_is_unloaded(stubs: StubPool,
                                                                                    tmp_path: Path) -> None:
    """The replica answers 409 to an unload (requests in flight on that version there that this
    gateway does not count: another gateway's): the request is not answered by that refusal. It waits
    for a slot within its bound, the replica tried again only after each read of its /health (never
    in a loop), then gets a 503 with Retry-After naming why; the version stays loaded. Once the
    version is free there, the next request gets its slot (issue #54)."""
    path = tmp_path / "adapters.json"
    path.write_text(json.dumps(SPEC))
    with run_gateway({"r0": stubs.urls["r0"]}, "--api-key", KEY, "--adapters-file", str(path), "--lora-slots", "1",
                     "--refresh-interval-s", "0.5", "--request-timeout-s", str(SLOT_BOUND_S)) as gw:
        gw.wait_eligible({"r0"})
        sdk(gw).completions.create(model="a@1", prompt=[1], max_tokens=2)
        assert set(stubs.adapters["r0"]) == {"a.1.1"}
        stubs.busy.add("a.1.1")
        r = httpx.post(gw.url + "/v1/completions", json={"model": "b@1", "prompt": [1]}, headers=AUTH, timeout=60)
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        err = r.json()["error"]
        assert err["type"] == "no_replica" and f"within {SLOT_BOUND_S:g}s" in err["message"], err
        assert "r0:" in err["message"], err
        assert set(stubs.adapters["r0"]) == {"a.1.1"}
        # Tried again after each /health read at most (0.5 s apart), not in a loop.
        assert 1 <= refused_unloads(gw, "r0") <= SLOT_BOUND_S / 0.5 + 2
        stubs.busy.clear()
        raw = sdk(gw).completions.with_raw_response.create(model="b@1", prompt=[1], max_tokens=2)
        assert raw.headers["x-sampler-adapter"] == "b@1" and set(stubs.adapters["r0"]) == {"b.1.3"}


def test_a_refused_unload_is_placed_on_another_replica(stubs: StubPool, tmp_path: Path) -> None:
    path = tmp_path / "adapters.json"
    path.write_text(json.dumps(SPEC))
    with run_gateway(stubs.urls, "--api-key", KEY, "--adapters-file", str(path), "--lora-slots", "1",
                     "--refresh-interval-s", "0.5", "--request-timeout-s", str(SLOT_BOUND_S)) as gw:
        gw.wait_eligible({"r0", "r1"})
        # One version on each replica, both busy at the replicas but idle for this gateway.
        sdk(gw).completions.create(model="a@1", prompt=[1], max_tokens=2)
        sdk(gw).completions.create(model="b@1", prompt=[1], max_tokens=2)
        assert sorted(n for held in stubs.adapters.values() for n in held) == ["a.1.1", "b.1.3"]
        first = next(r for r, held in stubs.adapters.items() if "a.1.1" in held)
        stubs.busy.add("a.1.1")
        stubs.busy.add("b.1.3")
        r = httpx.post(gw.url + "/v1/completions", json={"model": "a@2", "prompt": [1]}, headers=AUTH, timeout=60)
        # Both refused, past its bound: a 503 with Retry-After; nothing unloaded.
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert sorted(n for held in stubs.adapters.values() for n in held) == ["a.1.1", "b.1.3"]
        assert refused_unloads(gw, "r0") >= 1 and refused_unloads(gw, "r1") >= 1
        stubs.busy.discard("b.1.3")
        # Now one replica refuses and the other does not: a@2 lands where b.1.3 was.
        raw = sdk(gw).completions.with_raw_response.create(model="a@2", prompt=[1], max_tokens=2)
        assert raw.headers["x-sampler-adapter"] == "a@2" and raw.headers["x-sampler-replica"] != first
        assert stubs.adapters[first] == {"a.1.1": "/ckpt/a/1"}


def test_a_replica_full_beyond_what_the_gateway_knew_places_the_request_elsewhere(stubs: StubPool,
                                                                                  tmp_path: Path) -> None:
    """Each replica holds one adapter at most (the gateway counts one slot too): a version loaded
    behind the gateway's back fills r's only slot; the add there is a 409 (full), and the request
    goes to the other replica, never over a replica's capacity. With both full, it waits within its
    bound, each replica tried once until its /health is read again, then a 503 with Retry-After."""
    path = tmp_path / "adapters.json"
    path.write_text(json.dumps(SPEC))
    # /health read once a minute: the gateway's view stays what it was, but for its own news.
    with run_gateway(stubs.urls, "--api-key", KEY, "--adapters-file", str(path), "--lora-slots", "1",
                     "--refresh-interval-s", "60", "--request-timeout-s", str(SLOT_BOUND_S)) as gw:
        gw.wait_eligible({"r0", "r1"})
        stubs.capacity = 1
        for name in ("a@1", "b@1"):
            sdk(gw).completions.create(model=name, prompt=[1], max_tokens=2)
        # Fill each replica behind the gateway's back: its /health does not say so until it is read.
        for replica in stubs.adapters:
            stubs.adapters[replica] = {"x.1.99": "/elsewhere"}
        r = httpx.post(gw.url + "/v1/completions", json={"model": "a@2", "prompt": [1]}, headers=AUTH, timeout=60)
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert "refused a load or unload just now" in r.json()["error"]["message"], r.text
        assert all(len(held) == 1 for held in stubs.adapters.values())
        full = sum(metric(gw.metrics(), "sampler_gateway_adapter_loads_total", 0.0, replica=n, outcome="full")
                   for n in ("r0", "r1"))
        assert full == 2.0  # each replica tried once: no read since
        stubs.adapters["r1"] = {}
        # A change of the replica set has the gateway read every /health at once (discovery/refresh.py).
        seen = gw.health()["refreshes"]
        write_replicas(gw.replicas_file, [{"name": n, "url": u} for n, u in stubs.urls.items()])
        gw.wait(lambda h: h["refreshes"] > seen, "a read of every replica")
        raw = sdk(gw).completions.with_raw_response.create(model="a@2", prompt=[1], max_tokens=2)
        assert raw.headers["x-sampler-replica"] == "r1" and stubs.adapters["r1"] == {"a.2.2": "/ckpt/a/2"}
