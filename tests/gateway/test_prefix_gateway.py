"""Issue #52 through a real gateway process in front of real fake-engine sampler processes (127.0.0.1):
the scorer reads each replica's block size from its `/health`, siblings of one prompt sent at once as
separate requests land on one replica, unrelated prompts still spread, a prompt family's later
requests follow its blocks, and a request that asks why gets the decision back. (Real vLLM
replicas, whose own prefix-cache counters show the hits: tests/engine/test_prefix_routing_real.py.)"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sampler_pod.engine.fake import FAKE_KV_BLOCK_SIZE
from tests.support.gateway import RunningGateway, fake_replicas, run_gateway
from tests.support.metrics import metric

BS = FAKE_KV_BLOCK_SIZE


@pytest.fixture(scope="module")
def gw(tiny_model: Path) -> Iterator[RunningGateway]:
    with fake_replicas(tiny_model, ["r0", "r1", "r2"]) as pool, run_gateway(pool.urls()) as gw:
        gw.wait(lambda h: sum(r["eligible"] and r["engine"]["block_size"] == BS for r in h["replicas"]) == 3,
                "three eligible replicas reporting their block size")
        yield gw


def body(family: int, own: int, max_tokens: int = 20) -> dict[str, Any]:
    """A native sample of 3 whole blocks shared by the family and one of its own (`own`)."""
    return {"prompts": [[family] * (3 * BS) + [100 + own] * BS],
            "sampling_params": {"max_tokens": max_tokens, "temperature": 1.0}}


async def send(gw: RunningGateway, bodies: list[dict[str, Any]]) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=30) as c:
        return list(await asyncio.gather(*(c.post(gw.url + "/v1/sample", json=b, headers={"X-Sampler-Explain": "1"})
                                           for b in bodies)))


def test_siblings_sent_at_once_land_on_one_replica_and_unrelated_prompts_spread(gw: RunningGateway) -> None:
    for family in (1, 2, 3):
        answers = asyncio.run(send(gw, [body(family, 0)] * 8))
        assert all(r.status_code == 200 for r in answers), [r.text for r in answers]
        assert len({r.headers["x-sampler-replica"] for r in answers}) == 1
        rules = [json.loads(r.headers["x-sampler-route"])["rule"] for r in answers]
        # The first of them by load; the rest joined it (as a burst, or by its blocks while it was cool).
        assert rules.count("least-loaded") == 1 and set(rules) <= {"least-loaded", "burst", "prefix"}, rules
    # Unrelated prompts (nothing in common, one at a time on an idle pool) spread over every replica.
    spread = [asyncio.run(send(gw, [{"prompts": [[200 + i] * (2 * BS)],
                                     "sampling_params": {"max_tokens": 2}}]))[0] for i in range(6)]
    assert {r.headers["x-sampler-replica"] for r in spread} == {"r0", "r1", "r2"}


def test_a_familys_later_requests_follow_its_blocks_and_say_why(gw: RunningGateway) -> None:
    first = asyncio.run(send(gw, [body(7, 0, max_tokens=2)]))[0]
    home = first.headers["x-sampler-replica"]
    later = asyncio.run(send(gw, [body(7, i, max_tokens=2) for i in range(1, 4)]))
    for r in later:
        why = json.loads(r.headers["x-sampler-route"])
        assert r.headers["x-sampler-replica"] == home and why["rule"] == "prefix", why
        assert why["chosen"]["overlap"] == 0.75 and why["runner_up"]["replica"] != home
        assert why["chosen"]["score"] >= why["runner_up"]["score"]
    text = gw.metrics()
    assert metric(text, "sampler_gateway_routed_by_rule_total", 0.0, rule="prefix") >= 3
    held = metric(text, "sampler_gateway_prompt_blocks_held_total", 0.0)
    assert 0 < held <= metric(text, "sampler_gateway_prompt_blocks_total", 0.0)
    # Not asked: no header.
    with httpx.Client(timeout=30) as c:
        plain = c.post(gw.url + "/v1/sample", json=body(7, 9, max_tokens=2))
    assert plain.status_code == 200 and "x-sampler-route" not in plain.headers
