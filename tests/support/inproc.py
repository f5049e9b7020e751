"""An in-process app on the fake engine, for fast route and logic tests."""

from __future__ import annotations

import tempfile
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
