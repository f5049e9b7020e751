"""Issue #24, acceptance 1: labels ordered by the trainer's `step`, not by a replica's load counter,
through real processes (a gateway with static discovery over fake-engine samplers).

r0 loads step-8 then step-9 (its version 2); r1 is a fresh process started at step-10 (its own
version 1). By the replicas' versions a gateway that sees both labels at once would rank step-9
newest (the rule before #24); by step it routes only to step-10. Every answer through it carries
that step: natively and on Twinkle in the body and the gateway's `X-Sampler-Weights-Step`, on Tinker
in the replica's header, read here through the real SDK's transport."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker
from tinker import types

from tests.support.gateway import run_gateway
from tests.support.server import run_server, wait_healthy

SHORT = {"prompts": [[5, 6, 7]], "sampling_params": {"max_tokens": 4}}


def test_a_gateway_started_later_routes_by_step_not_by_version(tiny_model: Path, tmp_path: Path) -> None:
    for label in ("step-8", "step-9", "step-10"):
        (tmp_path / label).mkdir()
        os.link(tiny_model / "model.safetensors", tmp_path / label / "model.safetensors")
    root = ("--checkpoint-root", str(tmp_path))
    with contextlib.ExitStack() as stack:
        r0 = stack.enter_context(run_server(tiny_model, *root, engine="fake", wait=False))
        r1 = stack.enter_context(run_server(tiny_model, *root, "--initial-checkpoint", str(tmp_path / "step-10"),
                                            "--initial-version-label", "step-10", "--initial-step", "10",
                                            engine="fake", wait=False))
        for s in (r0, r1):
            wait_healthy(s.url, s.proc, s.log_path, timeout=120)
        for step in (8, 9):
            r = httpx.post(r0.url + "/v1/checkpoints/load",
                           json={"path": f"step-{step}", "version_label": f"step-{step}", "step": step})
            assert r.status_code == 200 and r.json()["weights_step"] == step, r.text
        h0, h1 = httpx.get(r0.url + "/health").json(), httpx.get(r1.url + "/health").json()
        assert (h0["weights_label"], h0["weights_version"], h0["weights_step"]) == ("step-9", 2, 9)
        assert (h1["weights_label"], h1["weights_version"], h1["weights_step"]) == ("step-10", 1, 10)
        # A bad step is a 400 naming it, nothing loaded.
        r = httpx.post(r0.url + "/v1/checkpoints/load", json={"path": "step-9", "version_label": "x", "step": -1})
        assert r.status_code == 400 and r.json()["error"]["field"] == "step", r.text

        with run_gateway({"r0": r0.url, "r1": r1.url}, "--version-policy", "Latest") as gw:
            h = gw.wait(lambda h: sum(1 for r in h["replicas"] if r["ready"]) == 2, "both replicas read")
            assert h["labels"][-1] == "step-10", h["labels"]
            for _ in range(8):
                r = httpx.post(gw.url + "/v1/sample", json=SHORT, timeout=60)
                assert r.status_code == 200, r.text
                assert r.headers["x-sampler-replica"] == "r1" and r.json()["weights_label"] == "step-10"
                assert r.json()["weights_step"] == 10  # every answer carries the step of its weights
                assert r.headers["x-sampler-weights-step"] == "10"  # and the gateway stamps it
            twinkle = httpx.post(f"{gw.url}/api/v1/sampler/{tiny_model.name}/twinkle/sample", timeout=60,
                                 json={"inputs": [{"input_ids": [5, 6, 7]}], "sampling_params": {"max_tokens": 4}})
            assert twinkle.status_code == 200, twinkle.text
            assert twinkle.json()["weights_step"] == 10 and twinkle.headers["x-sampler-weights-step"] == "10"
            assert tinker_steps(gw.url, tiny_model) == ["10"] * 3


def tinker_steps(url: str, model: Path) -> list[str | None]:
    """Three samples through the REAL Tinker SDK; the step header of each answer that completed one.
    The SDK hides response headers, so its transport (httpx's AsyncClient.send) is wrapped meanwhile,
    as examples/rl_loop.py reads the spans."""
    seen: list[str | None] = []
    original = httpx.AsyncClient.send

    async def send(client: httpx.AsyncClient, request: httpx.Request, **kw: Any) -> httpx.Response:
        response = await original(client, request, **kw)
        if request.url.path.endswith("/retrieve_future") and response.status_code == 200 \
                and "x-sampler-weights-label" in response.headers:  # a result, not a try_again
            seen.append(response.headers.get("x-sampler-weights-step"))
        return response

    sc = tinker.ServiceClient(base_url=url, api_key="tml-unused")
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(httpx.AsyncClient, "send", send)
            client = sc.create_sampling_client(base_model=str(model)).result()
            for _ in range(3):
                result = client.sample(types.ModelInput.from_ints([5, 6, 7]), 1,
                                       types.SamplingParams(max_tokens=4)).result(timeout=60)
                assert len(result.sequences[0].tokens) == 4  # the SDK parsed the answer the header came with
    finally:
        sc.close("success").result()
    return seen


def test_a_restart_keeps_the_step(tiny_model: Path, tmp_path: Path) -> None:
    (tmp_path / "ckpt" / "step-3").mkdir(parents=True)
    os.link(tiny_model / "model.safetensors", tmp_path / "ckpt" / "step-3" / "model.safetensors")
    state = tmp_path / "weights.json"
    flags = ("--checkpoint-root", str(tmp_path / "ckpt"), "--weights-state-path", str(state))
    with run_server(tiny_model, *flags, engine="fake") as s:
        r = httpx.post(s.url + "/v1/checkpoints/load", json={"path": "step-3", "version_label": "step-3", "step": 3})
        assert r.status_code == 200, r.text
    with run_server(tiny_model, *flags, engine="fake") as s:  # the state file, no --initial-* flags
        h = httpx.get(s.url + "/health").json()
        assert (h["weights_label"], h["weights_step"], h["intended"]["step"]) == ("step-3", 3, 3), h
