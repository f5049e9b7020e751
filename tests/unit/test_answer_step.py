"""Issue #24: every answer reports the training step of its weights where one is known, on every
protocol, each where its wire has room (docs/reference/contract.md): the native routes and Twinkle's `sample`
in the body (`weights_step`, null when no load named a step), Tinker in the header
`X-Sampler-Weights-Step` (its SDK builds frozen dataclasses of the wire's fields; absent when no
step is known). In-process on the fake engine; through a gateway and the real Tinker SDK in
tests/gateway/test_label_steps.py."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.support.inproc import fake_client
from tests.unit.test_protocols_tinker import sample_body as tinker_body
from tests.unit.test_weights_restore import PROMPT, Ckpts, inproc, variant

TWINKLE = "/api/v1/sampler/fake/twinkle/sample"
STEP_HEADER = "x-sampler-weights-step"


@pytest.fixture(scope="module")
def ck(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Ckpts:
    root = tmp_path_factory.mktemp("step") / "checkpoints"
    variant(tiny_model, root / "step-7", seed=7)
    variant(tiny_model, root / "nostep", seed=8)
    return Ckpts(tiny_model, root)


async def answers(c: httpx.AsyncClient) -> tuple[httpx.Response, httpx.Response, httpx.Response]:
    """One answer per protocol: native sync, Twinkle sample, Tinker retrieve_future (protobuf, as the SDK asks)."""
    native = await c.post("/v1/sample", json={"prompts": [PROMPT], "sampling_params": {"max_tokens": 3}})
    twinkle = await c.post(TWINKLE, json={"inputs": [{"input_ids": PROMPT}], "sampling_params": {"max_tokens": 3}})
    k = await c.post("/api/v1/asample", json=tinker_body(sampling_params={"max_tokens": 3}))
    assert k.status_code == 200, k.text
    tinker = await c.post("/api/v1/retrieve_future", json={"request_id": k.json()["request_id"]},
                          headers={"Accept": "application/x-protobuf"})
    for r in (native, twinkle, tinker):
        assert r.status_code == 200, r.text
    return native, twinkle, tinker


async def test_every_protocol_reports_the_step_where_one_is_known(ck: Ckpts, tmp_path: Path) -> None:
    core, _ = inproc(ck, tmp_path)
    async with fake_client(core) as c:
        # The base model: no load named a step.
        native, twinkle, tinker = await answers(c)
        assert native.json()["weights_step"] is None and twinkle.json()["weights_step"] is None
        assert STEP_HEADER not in tinker.headers

        r = await c.post("/v1/checkpoints/load", json={"path": "step-7", "version_label": "step-7", "step": 7})
        assert r.status_code == 200 and r.json()["weights_step"] == 7, r.text
        native, twinkle, tinker = await answers(c)
        assert (native.json()["weights_label"], native.json()["weights_step"]) == ("step-7", 7)
        assert (twinkle.json()["weights_label"], twinkle.json()["weights_step"]) == ("step-7", 7)
        assert tinker.headers["x-sampler-weights-label"] == "step-7" and tinker.headers[STEP_HEADER] == "7"

        # A later load without a step: the answers stop claiming the old one.
        r = await c.post("/v1/checkpoints/load", json={"path": "nostep", "version_label": "nostep"})
        assert r.status_code == 200 and r.json()["weights_step"] is None, r.text
        native, twinkle, tinker = await answers(c)
        assert native.json()["weights_step"] is None and twinkle.json()["weights_step"] is None
        assert tinker.headers["x-sampler-weights-label"] == "nostep" and STEP_HEADER not in tinker.headers
