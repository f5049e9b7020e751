"""Twinkle-native route over the fake engine: request/response shape, seeds, stop reasons, refusals."""

from __future__ import annotations

from typing import Any

import pytest

from sampler_pod.engine.base import AdapterRef
from tests.support.inproc import fake_client, fake_core


def body(inputs: Any = None, **sp: Any) -> dict[str, Any]:
    return {"inputs": inputs if inputs is not None else [{"input_ids": [1, 2, 3]}],
            "sampling_params": {"max_tokens": 5, **sp}}


async def test_shape_multiple_inputs_and_samples() -> None:
    core, _ = fake_core()
    async with fake_client(core) as c:
        r = await c.post("/twinkle/sample", json=body([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}],
                                                      num_samples=2, seed=1, prompt_logprobs=0))
        assert r.status_code == 200, r.text
        out = r.json()
        assert len(out["samples"]) == 2 and out["weights_version"] == 0
        for sample, plen in zip(out["samples"], [3, 2], strict=True):
            assert len(sample["sequences"]) == 2
            assert len(sample["prompt_logprobs"]) == plen and sample["prompt_logprobs"][0] is None
            for seq in sample["sequences"]:
                assert seq["stop_reason"] == "length" and len(seq["tokens"]) == 5 == len(seq["logprobs"])
        # A single InputFeature (not a list) is one input.
        single = (await c.post("/twinkle/sample", json=body({"input_ids": [1, 2, 3]}, seed=1))).json()
        assert len(single["samples"]) == 1


async def test_seeds_reproduce_and_differ() -> None:
    core, _ = fake_core()
    async with fake_client(core) as c:
        a, b, other = [
            (await c.post("/twinkle/sample", json=body(seed=s))).json()["samples"][0]["sequences"][0]["tokens"]
            for s in (7, 7, 8)
        ]
        assert a == b != other


async def test_stop_token_gives_stop_reason() -> None:
    core, engine = fake_core()
    async with fake_client(core) as c:
        r = await c.post("/twinkle/sample", json=body(seed=1, stop=list(range(engine.vocab_size))))
        seq = r.json()["samples"][0]["sequences"][0]
        assert seq["stop_reason"] == "stop" and len(seq["tokens"]) == 1


@pytest.mark.parametrize("payload,field", [
    (body(repetition_penalty=1.2), "sampling_params.repetition_penalty"),
    (body(include_stop_str_in_output=True), "sampling_params.include_stop_str_in_output"),
    (body(typo_param=1), "sampling_params.typo_param"),
    (body(top_k=0), "sampling_params.top_k"),
    (body(seed=-5), "sampling_params.seed"),
    (body({"messages": [{"role": "user", "content": "hi"}]}), "inputs[0]"),
    (body([{"input_ids": [1, 2], "attention_mask": [0, 1]}]), "inputs[0].attention_mask"),
    (body([{"input_ids": []}]), "inputs[0].input_ids"),
    ({**body(), "adapter_name": "nope"}, "adapter"),
    ({**body(), "adapter_uri": "twinkle://run/weights/nope"}, "adapter_uri"),
    ({**body(), "extra": 1}, "extra"),
])
async def test_refusals_name_the_field(payload: dict[str, Any], field: str) -> None:
    core, _ = fake_core()
    async with fake_client(core) as c:
        r = await c.post("/twinkle/sample", json=payload)
        assert r.status_code in (400, 404), r.text
        assert r.json()["error"]["field"] == field


async def test_adapter_by_name_or_uri() -> None:
    core, _ = fake_core()
    core.adapters["lora-a"] = AdapterRef(name="lora-a", lora_id=1, path="/x")
    async with fake_client(core) as c:
        base = (await c.post("/twinkle/sample", json=body(seed=1))).json()
        by_name = (await c.post("/twinkle/sample", json={**body(seed=1), "adapter_name": "lora-a"})).json()
        by_uri = (await c.post("/twinkle/sample", json={**body(seed=1), "adapter_uri": "twinkle://r/weights/lora-a"})).json()
        assert by_name["adapter"] == by_uri["adapter"] == "lora-a"
        assert by_name["samples"] == by_uri["samples"] != base["samples"]


async def test_api_key_applies_to_twinkle() -> None:
    core, _ = fake_core(api_key="tml-secret")
    async with fake_client(core) as c:
        assert (await c.post("/twinkle/sample", json=body())).status_code == 401
        assert (
            await c.post("/twinkle/sample", json=body(), headers={"Authorization": "Bearer tml-secret"})
        ).status_code == 200
