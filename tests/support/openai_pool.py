"""A gateway over 2 real vLLM CPU replicas, the OpenAI API behind one key: the pool the engine tier's
OpenAI-through-a-gateway tests share (tests/engine/conftest.py, `openai_pool`). Starting its two engines
is the expensive part (~15 s each on the CPU build), so it is started once for all of them, both at once."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai

from tests.support.gateway import RunningGateway, run_gateway
from tests.support.server import RunningServer, run_servers

KEY = "k-openai-real"
NAMES = ("r0", "r1")


@dataclass
class OpenAIPool:
    servers: dict[str, RunningServer]
    gw: RunningGateway
    client: openai.OpenAI
    model: str


@contextlib.contextmanager
def run_openai_pool(model_dir: Path) -> Iterator[OpenAIPool]:
    with contextlib.ExitStack() as stack:
        servers = stack.enter_context(run_servers(model_dir, {n: ["--api-key", KEY] for n in NAMES}))
        gw = stack.enter_context(run_gateway({n: s.url for n, s in servers.items()}, "--api-key", KEY))
        gw.wait_eligible(set(NAMES), timeout=60)
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        yield OpenAIPool(servers, gw, client, client.models.list().data[0].id)
