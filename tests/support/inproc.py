"""An in-process app on the fake engine, for fast route and logic tests."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Callable
from pathlib import Path

import httpx

from sampler_pod.config import ServerConfig
from sampler_pod.core.sampler import SamplerCore
from sampler_pod.engine.fake import FakeEngine
from sampler_pod.http.app import create_app


def fake_core(token_delay_s: float = 0.001, **cfg: object) -> tuple[SamplerCore, FakeEngine]:
    # A private state file: never the pod default under /var/run/sampler.
    cfg.setdefault("weights_state_path", Path(tempfile.mkdtemp(prefix="sampler-state-")) / "weights.json")
    core = SamplerCore(ServerConfig(model="fake", engine="fake", **cfg))
    engine = FakeEngine(token_delay_s=token_delay_s)
    core.engine = engine
    return core, engine


def fake_client(core: SamplerCore) -> httpx.AsyncClient:
    async def no_start(_core: SamplerCore) -> None:
        return None

    app = create_app(core.cfg, no_start, core=core)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def outcomes(core: SamplerCore) -> dict[str, float]:
    """`sampler_requests_finished_total` by outcome, as /metrics reports it."""
    return {s.labels["outcome"]: s.value for m in core.metrics.finished.collect() for s in m.samples
            if s.name.endswith("_total")}


async def until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    """Wait for a state of the (single-threaded) event loop, yielding to it in between; fail past timeout."""
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.001)
