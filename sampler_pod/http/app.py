"""`create_app`: the FastAPI application, assembled in one place (the shape of vLLM's `build_app`).

Routers are thin and hold no state: the services live on `app.state` (`core`, `weights`,
`tinker`), and authentication is applied here, once, to every router but the probes: the API key
on sampling and reads, the admin key on the routers that change weights or adapters (`sampler_common/http/auth.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from fastapi import Depends, FastAPI, Request
from starlette.routing import Route

from sampler_common.errors import NotFound
from sampler_common.http.auth import APIKeyAuth
from sampler_common.http.errors import install_error_handlers
from sampler_common.http.middleware import ClientRequestMiddleware

from ..config import ServerConfig
from ..core.sampler import SamplerCore
from ..core.startup import EngineStarter
from ..openai.paths import OPENAI_PATHS
from ..protocols import tinker, twinkle
from ..weights.digest_load import DigestLoads
from ..weights.service import WeightsService
from ..weights.transfer import WeightTransferService

if TYPE_CHECKING:
    from ..openai.app import OpenAIRoutes
from .routes import health, native, test_seams, weight_transfer, weights

log = logging.getLogger(__name__)


async def _needs_vllm(request: Request) -> None:
    raise NotFound(f"{request.url.path} is vLLM's own OpenAI-compatible API: it needs --engine vllm "
                   "(this server runs --engine fake)", field="path")


def build_openai_app(core: SamplerCore, auth: APIKeyAuth) -> OpenAIRoutes:
    from ..openai.app import build_openai_app as build  # imports vLLM: only for --engine vllm

    return build(core, auth)


def create_app(cfg: ServerConfig, start_engine: EngineStarter, core: SamplerCore | None = None,
               weights_service: WeightsService | None = None) -> FastAPI:
    """`weights_service` (on `core`) when the caller's starter needs it too (the startup restore)."""
    core = core or SamplerCore(cfg)
    auth = APIKeyAuth(cfg.api_key, cfg.admin_api_key)
    openai_routes = build_openai_app(core, auth) if cfg.engine == "vllm" else None

    async def start(core: SamplerCore) -> None:
        await start_engine(core)
        if openai_routes is not None and core.engine is not None and core.model_dir is not None:
            from ..engine.vllm import VllmEngine

            assert isinstance(core.engine, VllmEngine)
            # Not ready (/health `starting`) until these routes serve too: a gateway must not route to a
            # replica whose OpenAI routes would answer 503.
            core.restoring = "vLLM's OpenAI-compatible routes are starting"
            try:
                await openai_routes.start(core.engine, core, cfg, core.model_dir)
            except Exception as e:  # e.g. an unknown --tool-call-parser: engine_dead, so the kubelet restarts it
                core.startup_error = f"vLLM's OpenAI-compatible routes failed to start: {type(e).__name__}: {e}"
                log.exception("%s", core.startup_error)
            finally:
                core.restoring = None

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Start the engine in the background so /healthz and /health answer ("starting") at once.
        app.state.startup_task = asyncio.create_task(start(core))
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
    app.state.transfer = WeightTransferService(core, app.state.weights)
    app.state.digest_loads = DigestLoads(core, app.state.weights, app.state.transfer)
    app.state.tinker = tinker.TinkerService(core)
    app.state.twinkle = twinkle.TwinkleService(core, app.state.weights, cfg.twinkle_session_ttl_s)
    app.add_middleware(ClientRequestMiddleware, max_bytes=cfg.max_body_bytes)
    install_error_handlers(app)

    for open_router in (health.router, tinker.probe_router, twinkle.probe_router):
        app.include_router(open_router)
    for router in (native.router, weights.router, weight_transfer.router, tinker.router, twinkle.router):
        app.include_router(router, dependencies=[Depends(auth.sampling)])
    for router in (weights.admin_router, weight_transfer.admin_router, twinkle.admin_router):
        app.include_router(router, dependencies=[Depends(auth.admin)])
    # vLLM's OpenAI-compatible routes: exactly these paths go to vLLM's own app (openai/app.py).
    for path in OPENAI_PATHS:
        app.router.routes.append(Route(path, openai_routes.guard) if openai_routes is not None
                                 else Route(path, _needs_vllm, methods=["GET", "POST"]))
    if cfg.enable_test_seams:
        app.include_router(test_seams.router, dependencies=[Depends(auth.admin)])
    return app
