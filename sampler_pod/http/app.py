"""`create_app`: the FastAPI application, assembled in one place (the shape of vLLM's `build_app`).

Routers are thin and hold no state: the services live on `app.state` (`core`, `weights`,
`tinker`), and authentication is applied here, once, to every router but the probes: the API key
on sampling and reads, the admin key on the routers that change weights or adapters (`sampler_common/http/auth.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from fastapi import Depends, FastAPI

from sampler_common.http.auth import APIKeyAuth
from sampler_common.http.errors import install_error_handlers
from sampler_common.http.middleware import ClientRequestMiddleware

from ..config import ServerConfig
from ..core.sampler import SamplerCore
from ..core.startup import EngineStarter
from ..protocols import tinker, twinkle
from ..weights.service import WeightsService
from .routes import health, native, test_seams, weights


def create_app(cfg: ServerConfig, start_engine: EngineStarter, core: SamplerCore | None = None,
               weights_service: WeightsService | None = None) -> FastAPI:
    """`weights_service` (on `core`) when the caller's starter needs it too (the startup restore)."""
    core = core or SamplerCore(cfg)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Start the engine in the background so /healthz and /health answer ("starting") at once.
        app.state.startup_task = asyncio.create_task(start_engine(core))
        core.futures.start()  # the futures' TTL sweep; stopped by futures.close() below
        core.start_watch()  # the engine stall watch (core/stall.py); stopped below
        try:
            yield
        finally:
            app.state.startup_task.cancel()
            await core.stop_watch()
            await core.futures.close()
            if core.engine is not None:
                await core.engine.shutdown()

    app = FastAPI(title="sampler-pod", version="0.1.0", lifespan=lifespan)
    app.state.core = core
    app.state.weights = weights_service or WeightsService(core)
    app.state.tinker = tinker.TinkerService(core)
    app.state.twinkle = twinkle.TwinkleService(core, app.state.weights, cfg.twinkle_session_ttl_s)
    app.add_middleware(ClientRequestMiddleware, max_bytes=cfg.max_body_bytes)
    install_error_handlers(app)

    for open_router in (health.router, tinker.probe_router, twinkle.probe_router):
        app.include_router(open_router)
    auth = APIKeyAuth(cfg.api_key, cfg.admin_api_key)
    for router in (native.router, weights.router, tinker.router, twinkle.router):
        app.include_router(router, dependencies=[Depends(auth.sampling)])
    for router in (weights.admin_router, twinkle.admin_router):
        app.include_router(router, dependencies=[Depends(auth.admin)])
    if cfg.enable_test_seams:
        app.include_router(test_seams.router, dependencies=[Depends(auth.admin)])
    return app
