"""Adapters beside the samples in flight, on the real vLLM CPU engine (issue #31, the replica's side;
docs/design/lora-pool.md, "Placement and eviction"). One server, `--max-loras 2 --max-cpu-loras 3`:
- with samples frozen in the engine (test seam), an adapter add completes, the new adapter is
  servable at once, and every frozen sample still finishes on its own weights (the base model, or
  its adapter), token for token as the same request alone;
- `/health` counts each adapter's requests in flight, native and OpenAI (`model` naming it) alike;
- `DELETE /v1/adapters/{name}` is a 409 naming the adapter while it has requests in flight;
- an add past `--max-cpu-loras` is a 409 naming `max_cpu_loras`;
- a request naming an adapter that is not loaded is a 4xx naming its field on every route, never
  the base model's answer.
The same logic on the fake engine, with Tinker and Twinkle too: tests/unit/test_adapter_in_flight.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.checkpoints import make_lora_adapter
from tests.support.server import RunningServer, engine_paused, run_server, wait_until

PROMPT = [1, 20, 30, 40, 50, 60, 70, 80]
TOKENS = 12
ADAPTERS = ("a", "b", "c", "d", "e", "text")


@dataclass
class Env:
    server: RunningServer
    c: httpx.Client


@pytest.fixture(scope="module")
def env(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    root = tmp_path_factory.mktemp("adapters-real") / "checkpoints"
    for i, name in enumerate(ADAPTERS):
        make_lora_adapter(tiny_model, root / name, seed=i + 1)
    # --load-timeout-s: an add that waited for the frozen samples (they never drain) would be a 504 by then.
    with run_server(tiny_model, "--enable-lora", "--max-loras", "2", "--max-cpu-loras", "3", "--checkpoint-root",
                    str(root), "--enable-test-seams", "--load-timeout-s", "60") as s, s.client() as c:
        yield Env(s, c)


def native(adapter: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {"prompts": [PROMPT], "sampling_params": {"max_tokens": TOKENS, "temperature": 0.0,
                                                                     "ignore_eos": True}}
    if adapter is not None:
        body["adapter"] = adapter
    return body


def completion(model: str) -> dict[str, Any]:
    return {"model": model, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}


def tokens_of(r: httpx.Response) -> list[int]:
    assert r.status_code == 200, r.text
    return list(r.json()["results"][0]["sequences"][0]["tokens"])


def completion_tokens(r: httpx.Response) -> list[int]:
    assert r.status_code == 200, r.text
    return list(r.json()["choices"][0]["token_ids"])


def add(e: Env, name: str) -> httpx.Response:
    return e.c.post("/v1/adapters", json={"name": name, "path": name})


def adapters(e: Env) -> dict[str, dict[str, Any]]:
    return {a["name"]: a for a in e.c.get("/health").json()["adapters"]}


def held(e: Env) -> int:
    return int(e.c.get("/v1/test/engine/held").json()["held"])


def retrieve(e: Env, rid: str) -> httpx.Response:
    while (r := e.c.post("/v1/sample/retrieve", json={"request_id": rid, "wait_s": 30})).status_code == 202:
        pass  # still running: the long poll waited on it, ask again
    return r


def test_an_adapter_add_does_not_wait_for_samples_in_flight_and_they_finish_on_their_own_weights(env: Env) -> None:
    e = env
    assert add(e, "a").status_code == 200
    h = e.c.get("/health").json()
    assert (h["lora_slots"], h["max_loras"]) == (3, 2), h
    want = {"base": tokens_of(e.c.post("/v1/sample", json=native(None))),
            "a": tokens_of(e.c.post("/v1/sample", json=native("a")))}
    assert want["a"] != want["base"]
    # The OpenAI route's `model` names the adapter: the same tokens as the native route's.
    assert completion_tokens(e.c.post("/v1/completions", json=completion("a"))) == want["a"]

    with ThreadPoolExecutor(1) as pool, engine_paused(e.server):
        on_a = e.c.post("/v1/sample/submit", json=native("a")).json()["request_id"]
        on_base = e.c.post("/v1/sample/submit", json=native(None)).json()["request_id"]
        openai_a = pool.submit(lambda: e.server.post_alone("/v1/completions", json=completion("a")))
        wait_until(lambda: held(e) == 3, "3 requests held in the engine")
        assert adapters(e)["a"]["in_flight"] == 2  # the native one and the OpenAI one

        r = add(e, "b")  # the engine is frozen: an add that waited for the samples would never return
        assert r.status_code == 200, r.text
        on_b = e.c.post("/v1/sample/submit", json=native("b")).json()["request_id"]
        wait_until(lambda: held(e) == 4, "the request on the new adapter held in the engine too")
        h = adapters(e)
        assert (h["a"]["in_flight"], h["b"]["in_flight"]) == (2, 1) and h["b"]["last_used_at"] is not None, h

        r = e.c.delete("/v1/adapters/a")
        assert r.status_code == 409, r.text
        assert r.json()["error"]["field"] == "name" and "'a'" in r.json()["error"]["message"], r.text
        assert "a" in adapters(e)
        assert held(e) == 4  # nothing ran: the engine is still frozen
    # Thawed: every sample ends, each on the weights it was sent for.
    assert tokens_of(retrieve(e, on_a)) == want["a"]
    assert tokens_of(retrieve(e, on_base)) == want["base"]
    assert completion_tokens(openai_a.result()) == want["a"]
    got_b = tokens_of(retrieve(e, on_b))
    assert got_b == tokens_of(e.c.post("/v1/sample", json=native("b"))) and got_b not in (want["a"], want["base"])
    h = adapters(e)
    assert (h["a"]["in_flight"], h["b"]["in_flight"]) == (0, 0), h
    assert e.c.delete("/v1/adapters/a").status_code == 204
    # Unloaded: never answered by the base model in its place, on either route.
    r = e.c.post("/v1/sample", json=native("a"))
    assert r.status_code == 400 and r.json()["error"]["field"] == "adapter", r.text
    r = e.c.post("/v1/completions", json=completion("a"))
    assert r.status_code == 404 and r.json()["error"]["param"] == "model", r.text


def test_a_base_chat_request_is_never_given_an_adapter_named_like_its_content(env: Env) -> None:
    """vLLM's chat route would pick a "default multimodal LoRA" for a base request: an adapter whose
    name is a content part's type (`text`). Only `model` selects an adapter here."""
    e = env
    model = e.c.get("/v1/models").json()["data"][0]["id"]
    chat = {"model": model, "max_tokens": TOKENS, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "the quick brown fox"}]}]}

    def ask(body: dict[str, Any]) -> list[int]:
        r = e.c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return list(r.json()["choices"][0]["token_ids"])

    base = ask(chat)
    assert add(e, "text").status_code == 200
    try:
        on_text = ask({**chat, "model": "text"})
        assert on_text != base  # the adapter answers otherwise: the check below can fail
        assert ask(chat) == base
    finally:
        assert e.c.delete("/v1/adapters/text").status_code == 204


def test_an_add_past_max_cpu_loras_is_a_409_naming_it(env: Env) -> None:
    e = env
    for name in ("a", "b", "c", "d"):
        if name not in adapters(e) and len(adapters(e)) < 3:
            assert add(e, name).status_code == 200
    held_now = sorted(adapters(e))
    assert len(held_now) == 3, held_now
    extra = next(n for n in ADAPTERS if n not in held_now)
    r = add(e, extra)
    assert r.status_code == 409, r.text
    assert r.json()["error"]["field"] == "max_cpu_loras" and "(3)" in r.json()["error"]["message"], r.text
    assert sorted(adapters(e)) == held_now
    # All three still answer, each as itself (more than --max-loras: vLLM swaps them through its slots).
    answers = {n: tokens_of(e.c.post("/v1/sample", json=native(n))) for n in held_now}
    assert len({tuple(t) for t in answers.values()}) == 3, answers
    listed = {m["id"] for m in e.c.get("/v1/models").json()["data"]}
    assert set(held_now) <= listed and extra not in listed


def test_an_unknown_adapter_is_a_4xx_naming_the_field_on_every_route(env: Env) -> None:
    e = env
    r = e.c.post("/v1/sample", json=native("nope"))
    assert r.status_code == 400 and r.json()["error"]["field"] == "adapter", r.text
    r = e.c.post("/v1/completions", json=completion("nope"))
    assert r.status_code == 404 and r.json()["error"]["param"] == "model", r.text
    r = e.c.post("/v1/chat/completions", json={"model": "nope", "max_tokens": 4,
                                              "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model", r.text
    r = e.c.post("/inference/v1/generate", json={"model": "nope", "token_ids": PROMPT,
                                                 "sampling_params": {"max_tokens": 4}})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model", r.text
    assert all(a["in_flight"] == 0 for a in adapters(e).values())
