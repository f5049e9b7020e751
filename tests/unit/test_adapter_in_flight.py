"""Adapters beside the samples in flight, on the fake engine (issue #31, the replica's side;
docs/design/lora-pool.md, "Placement and eviction"):
- an adapter add or remove waits for no sample (only for a base-weights write);
- `/health` counts each adapter's requests in flight, on every route that can name one, and its last use;
- `DELETE /v1/adapters/{name}` is a 409 naming the adapter while it has requests in flight, and unloads nothing;
- an add past `--max-cpu-loras` is a 409 naming `max_cpu_loras`, and loads nothing.
The same on vLLM: tests/engine/test_adapters_in_flight_real.py.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from sampler_pod.core.adapter_use import AdapterUse
from sampler_pod.core.sampler import SamplerCore
from sampler_pod.engine.fake import FakeEngine
from sampler_pod.openai.calls import adapter_named
from tests.support.checkpoints import make_lora_adapter
from tests.support.inproc import fake_client, fake_core, outcomes, until
from tests.unit.test_protocols_tinker import sample_body as tinker_body

PROMPT = [1, 17, 42, 99]
TWINKLE = "/api/v1/sampler/fake/twinkle"


@pytest.fixture(scope="module")
def root(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("adapters") / "checkpoints"
    for i, name in enumerate(("lora-a", "lora-b", "lora-c")):
        make_lora_adapter(tiny_model, root / name, seed=i + 1)
    return root


def lora_core(tiny_model: Path, root: Path, tmp_path: Path, **cfg: Any) -> tuple[SamplerCore, FakeEngine]:
    core, engine = fake_core(enable_lora=True, checkpoint_roots=[root], weights_state_path=tmp_path / "w.json", **cfg)
    core.set_model_dir(str(tiny_model))
    return core, engine


def body(adapter: str | None = None, max_tokens: int = 8) -> dict[str, Any]:
    b: dict[str, Any] = {"prompts": [PROMPT], "sampling_params": {"max_tokens": max_tokens, "temperature": 0.0}}
    if adapter is not None:
        b["adapter"] = adapter
    return b


async def add(c: httpx.AsyncClient, name: str, path: str) -> httpx.Response:
    return await c.post("/v1/adapters", json={"name": name, "path": path})


async def health_adapters(c: httpx.AsyncClient) -> dict[str, dict[str, Any]]:
    return {a["name"]: a for a in (await c.get("/health")).json()["adapters"]}


def tokens(r: httpx.Response) -> list[int]:
    assert r.status_code == 200, r.text
    return list(r.json()["results"][0]["sequences"][0]["tokens"])


async def test_adapter_changes_wait_for_no_sample_and_in_flight_is_counted_on_every_route(
        tiny_model: Path, root: Path, tmp_path: Path) -> None:
    # A short load timeout: an add that waited for the frozen samples (the write lock) would be a 504.
    core, engine = lora_core(tiny_model, root, tmp_path, max_loras=2, max_cpu_loras=3, load_timeout_s=2)
    async with fake_client(core) as c:
        assert (await add(c, "a", "lora-a")).status_code == 200
        want_a, want_base = tokens(await c.post("/v1/sample", json=body("a"))), tokens(
            await c.post("/v1/sample", json=body()))
        assert want_a != want_base
        used_before = (await health_adapters(c))["a"]["last_used_at"]
        assert used_before is not None and used_before.endswith("Z")

        await engine.pause()  # every sample below stays in flight until resume
        sync = asyncio.ensure_future(c.post("/v1/sample", json=body("a")))
        future = (await c.post("/v1/sample/submit", json=body("a"))).json()["request_id"]
        tinker = (await c.post("/api/v1/asample", json=tinker_body(
            PROMPT, model_path="tinker://run/sampler_weights/a",
            sampling_params={"max_tokens": 8, "temperature": 0.0}))).json()["request_id"]
        twinkle = asyncio.ensure_future(c.post(TWINKLE + "/sample", json={
            "inputs": [{"input_ids": PROMPT}], "sampling_params": {"max_tokens": 8, "temperature": 0.0},
            "adapter_name": "a"}))
        base = (await c.post("/v1/sample/submit", json=body())).json()["request_id"]
        await until(lambda: len(engine.running) == 5)
        h = await health_adapters(c)
        assert h["a"]["in_flight"] == 4, h  # native sync and future, Tinker, Twinkle; not the base request

        # Frozen samples, and still: an add completes, and the new adapter is servable at once.
        r = await add(c, "b", "lora-b")
        assert r.status_code == 200, r.text
        on_b = (await c.post("/v1/sample/submit", json=body("b"))).json()["request_id"]
        await until(lambda: len(engine.running) == 6)
        h = await health_adapters(c)
        assert (h["a"]["in_flight"], h["b"]["in_flight"]) == (4, 1) and h["b"]["last_used_at"] is not None, h

        # An unload of an adapter in use: 409 naming it, and nothing unloaded anywhere.
        r = await c.delete("/v1/adapters/a")
        assert r.status_code == 409, r.text
        err = r.json()["error"]
        assert err["category"] == "conflict" and err["field"] == "name" and "'a'" in err["message"], err
        assert "a" in core.adapters and "a" in engine.adapters
        # An idle adapter is removed at once, requests in flight or not.
        assert (await add(c, "c", "lora-c")).status_code == 200
        assert (await c.delete("/v1/adapters/c")).status_code == 204 and "c" not in engine.adapters

        await engine.resume()
        got = [tokens(await sync), tokens(await c.post("/v1/sample/retrieve", json={"request_id": future,
                                                                                     "wait_s": 10}))]
        t = (await c.post("/api/v1/retrieve_future", json={"request_id": tinker})).json()
        got.append(t["sequences"][0]["tokens"])
        tw = await twinkle
        assert tw.status_code == 200, tw.text
        got.append(tw.json()["samples"][0]["sequences"][0]["tokens"])
        assert got == [want_a] * 4  # every one on its own adapter, as before the add
        assert tokens(await c.post("/v1/sample/retrieve", json={"request_id": base, "wait_s": 10})) == want_base
        b_tokens = tokens(await c.post("/v1/sample/retrieve", json={"request_id": on_b, "wait_s": 10}))
        assert b_tokens == tokens(await c.post("/v1/sample", json=body("b"))) and b_tokens != want_a

        h = await health_adapters(c)
        assert (h["a"]["in_flight"], h["b"]["in_flight"]) == (0, 0) and h["a"]["last_used_at"] > used_before, h
        assert outcomes(core) == {"ok": 9}  # 2 before, 5 frozen, 1 on b frozen, 1 on b after
        assert (await c.delete("/v1/adapters/a")).status_code == 204 and "a" not in engine.adapters


async def test_weights_spans_name_the_adapter_on_every_protocol(tiny_model: Path, root: Path, tmp_path: Path) -> None:
    """Every span of an answer sampled with an adapter names it (the engine name); a base-model
    span has no `adapter` key at all, as before adapters had one."""
    core, _ = lora_core(tiny_model, root, tmp_path)
    async with fake_client(core) as c:
        assert (await add(c, "a", "lora-a")).status_code == 200
        native = (await c.post("/v1/sample", json=body("a"))).json()["results"][0]["sequences"][0]["weights_spans"]
        assert native and all(sp["adapter"] == "a" for sp in native), native
        base = (await c.post("/v1/sample", json=body())).json()["results"][0]["sequences"][0]["weights_spans"]
        assert base and all("adapter" not in sp for sp in base), base
        tw = await c.post(TWINKLE + "/sample", json={"inputs": [{"input_ids": PROMPT}], "adapter_name": "a",
                                                       "sampling_params": {"max_tokens": 4}})
        assert tw.status_code == 200, tw.text
        assert all(sp["adapter"] == "a" for sp in tw.json()["samples"][0]["sequences"][0]["weights_spans"])
        tk = await c.post("/api/v1/asample", json=tinker_body(model_path="tinker://a"))
        assert tk.status_code == 200, tk.text
        done = await c.post("/api/v1/retrieve_future", json={"request_id": tk.json()["request_id"]})
        spans = json.loads(done.headers["X-Sampler-Weights-Spans"])
        assert spans and all(sp["adapter"] == "a" for seq in spans for sp in seq), spans


async def test_an_unload_races_no_admission(tiny_model: Path, root: Path, tmp_path: Path) -> None:
    """A request admitted for an adapter while its unload waited (behind another weights change) keeps
    it: the unload looks again once it may run, and is refused."""
    core, engine = lora_core(tiny_model, root, tmp_path)
    async with fake_client(core) as c:
        assert (await add(c, "a", "lora-a")).status_code == 200
        await core.mutations.acquire()  # a base-weights write in progress
        removing = asyncio.ensure_future(c.delete("/v1/adapters/a"))
        await until(lambda: bool(core.mutations._waiters))  # the unload waits for it
        await engine.pause()
        rid = (await c.post("/v1/sample/submit", json=body("a"))).json()["request_id"]
        core.mutations.release()
        r = await removing
        assert r.status_code == 409 and r.json()["error"]["field"] == "name", r.text
        assert "a" in core.adapters and "a" in engine.adapters
        await engine.resume()
        assert (await c.post("/v1/sample/retrieve", json={"request_id": rid, "wait_s": 10})).status_code == 200
        assert (await c.delete("/v1/adapters/a")).status_code == 204


async def test_an_adapter_change_waits_for_a_base_weights_write_not_for_samples(
        tiny_model: Path, root: Path, tmp_path: Path) -> None:
    core, _ = lora_core(tiny_model, root, tmp_path, load_timeout_s=0.05)
    async with fake_client(core) as c:
        assert (await add(c, "a", "lora-a")).status_code == 200
        await core.lock.acquire_read()  # a sample inside the weights' read side: no wait for it
        assert (await add(c, "b", "lora-b")).status_code == 200
        assert (await c.delete("/v1/adapters/b")).status_code == 204
        await core.lock.release_read()
        await core.mutations.acquire()  # a base-weights write (drain, abort, keep) holds this throughout
        r = await c.delete("/v1/adapters/a")
        core.mutations.release()
    assert r.status_code == 504, r.text
    err = r.json()["error"]
    assert err["category"] == "load_timeout" and "adapter 'a'" in err["message"] and err["field"] == "name", err
    assert "a" in core.adapters


async def test_an_add_past_max_cpu_loras_is_a_409_naming_it(tiny_model: Path, root: Path, tmp_path: Path) -> None:
    core, engine = lora_core(tiny_model, root, tmp_path, max_loras=1, max_cpu_loras=2)
    async with fake_client(core) as c:
        assert (await add(c, "a", "lora-a")).status_code == 200
        assert (await add(c, "b", "lora-b")).status_code == 200
        r = await add(c, "c", "lora-c")
        assert r.status_code == 409, r.text
        err = r.json()["error"]
        assert err["category"] == "conflict" and err["field"] == "max_cpu_loras" and "(2)" in err["message"], err
        # Twinkle's add goes the same way, with the same field.
        config = json.loads((root / "lora-c" / "adapter_config.json").read_text())
        r = await c.post(TWINKLE + "/add_adapter_to_sampler",
                         json={"adapter_name": "c", "config": config, "adapter_uri": "lora-c"})
        assert r.status_code == 409 and r.json()["error"]["field"] == "max_cpu_loras", r.text
        assert sorted(core.adapters) == sorted(engine.adapters) == ["a", "b"]
        assert [a["name"] for a in (await c.get("/v1/adapters")).json()] == ["a", "b"]
        assert json.loads((tmp_path / "w.json").read_text())["adapters"] == [
            {"name": n, "path": str((root / f"lora-{n}").resolve())} for n in ("a", "b")]
        cap = (await c.get("/api/v1/twinkle/capacity_info")).json()
        assert cap == {"max_loras": 2, "used_loras": 2, "free_loras": 0}
        assert (await c.delete("/v1/adapters/b")).status_code == 204
        assert (await add(c, "c", "lora-c")).status_code == 200


async def test_an_unknown_adapter_is_refused_naming_the_field_never_the_base_model(
        tiny_model: Path, root: Path, tmp_path: Path) -> None:
    core, _ = lora_core(tiny_model, root, tmp_path)
    async with fake_client(core) as c:
        r = await c.post("/v1/sample", json=body("nope"))
        assert r.status_code == 400 and r.json()["error"]["field"] == "adapter", r.text
        r = await c.post("/api/v1/asample", json=tinker_body(PROMPT, model_path="tinker://run/sampler_weights/nope"))
        assert r.status_code == 404 and "model_path" in r.text, r.text
        r = await c.post(TWINKLE + "/sample", json={"inputs": [{"input_ids": PROMPT}], "adapter_name": "nope"})
        assert r.status_code == 404 and r.json()["error"]["field"] == "adapter_name", r.text
        assert outcomes(core) == {} and core.adapter_use.in_flight("nope") == 0


@pytest.mark.parametrize(("flags", "slots", "max_loras"), [
    ({}, 0, 0),
    ({"enable_lora": True}, 4, 4),
    ({"enable_lora": True, "max_loras": 2, "max_cpu_loras": 6}, 6, 2),
])
async def test_health_reports_the_lora_slots(flags: dict[str, Any], slots: int, max_loras: int) -> None:
    core, _ = fake_core(**flags)
    async with fake_client(core) as c:
        h = (await c.get("/health")).json()
    assert (h["lora_slots"], h["max_loras"]) == (slots, max_loras), h


def test_adapter_use_counts_and_ages() -> None:
    clock = iter(f"t{i}" for i in range(100))
    use = AdapterUse(now=lambda: next(clock))
    assert (use.in_flight("a"), use.last_used_at("a")) == (0, None)
    use.begin("a")
    use.begin("a")
    use.end("a")
    assert (use.in_flight("a"), use.last_used_at("a")) == (1, "t2")
    use.end("a")
    assert (use.in_flight("a"), use.last_used_at("a")) == (0, "t3")
    use.forget("a")
    assert use.last_used_at("a") is None


def test_the_openai_routes_count_the_adapter_their_model_names() -> None:
    loaded = {"a", "b"}
    assert adapter_named({"model": "a", "prompt": "x"}, loaded) == "a"
    assert adapter_named({"model": "base"}, loaded) is None
    assert adapter_named({"model": ["a"]}, loaded) is None and adapter_named(None, loaded) is None
