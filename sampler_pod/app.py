"""The FastAPI application: thin routes over `SamplerCore` (shape of vLLM's entrypoints/)."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from .config import ServerConfig
from .core import SamplerCore
from .errors import BodyTooLarge, InvalidRequest, SamplerError, Unauthorized
from .health import liveness_ok
from .schemas import RetrieveRequest, SampleRequest, SampleResponse, SubmitResponse

log = logging.getLogger(__name__)

EngineStarter = Callable[[SamplerCore], Awaitable[None]]


def create_app(cfg: ServerConfig, start_engine: EngineStarter, core: SamplerCore | None = None) -> FastAPI:
    core = core or SamplerCore(cfg)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Start the engine in the background so /healthz and /health answer ("starting") at once.
        app.state.startup_task = asyncio.create_task(start_engine(core))
        try:
            yield
        finally:
            app.state.startup_task.cancel()
            await core.futures.close()
            if core.engine is not None:
                await core.engine.shutdown()

    app = FastAPI(title="sampler-pod", version="0.1.0", lifespan=lifespan)
    app.state.core = core
    app.add_middleware(BodyLimitMiddleware, max_bytes=cfg.max_body_bytes)
    _install_error_handlers(app)
    app.include_router(health_router(core))
    app.include_router(native_router(core), dependencies=[Depends(api_key_checker(cfg.api_key))])
    from .weights_routes import weights_router

    app.include_router(weights_router(core), dependencies=[Depends(api_key_checker(cfg.api_key))])
    from .protocols.tinker import tinker_router
    from .protocols.twinkle import twinkle_router

    app.include_router(tinker_router(core, cfg.api_key))
    app.include_router(twinkle_router(core, cfg.api_key, cfg.twinkle_session_ttl_s))
    return app


# ---------------------------------------------------------------------- errors


def error_response(e: SamplerError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status_code, headers=e.headers)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(SamplerError)
    async def _sampler_error(_req: Request, e: SamplerError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _validation(_req: Request, e: RequestValidationError) -> JSONResponse:
        # Name the offending field the way a client wrote it: "sampling_params.top_p", "prompts[0][3]".
        first = e.errors()[0]
        loc = [p for p in first.get("loc", ()) if p != "body"]
        field = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or "body"
        return error_response(InvalidRequest(f"{field}: {first.get('msg')}", field=field))


class BodyLimitMiddleware:
    """Refuse bodies over the limit before they are read into memory (413 naming `body`)."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_big = BodyTooLarge(f"request body is over {self.max_bytes} bytes", field="body")
        for k, v in scope.get("headers", []):
            if k == b"content-length" and v.isdigit() and int(v) > self.max_bytes:
                return await error_response(too_big)(scope, receive, send)
        seen = 0

        async def limited_receive() -> Any:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    raise too_big
            return msg

        try:
            await self.app(scope, limited_receive, send)
        except BodyTooLarge as e:
            await error_response(e)(scope, receive, send)


def api_key_checker(api_key: str | None) -> Callable[[Request], None]:
    def check(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("x-api-key") or ""
        auth = request.headers.get("authorization") or ""
        if auth.lower().startswith("bearer "):
            given = given or auth[7:]
        # Constant-time comparison: no timing oracle on the key.
        if not hmac.compare_digest(given.encode(), api_key.encode()):
            raise Unauthorized("missing or wrong API key (X-API-Key or Authorization: Bearer)")

    return check


# ---------------------------------------------------------------------- routes


def health_router(core: SamplerCore) -> APIRouter:
    r = APIRouter(tags=["health"])

    @r.get("/healthz")
    async def healthz() -> Response:
        status = core.health().status
        return JSONResponse({"alive": liveness_ok(status), "status": status},
                            status_code=200 if liveness_ok(status) else 503)

    @r.get("/readyz")
    async def readyz() -> Response:
        h = core.health()
        return JSONResponse({"ready": h.status == "ok", "status": h.status, "reason": h.reason},
                            status_code=200 if h.status == "ok" else 503)

    @r.get("/health")
    async def health() -> Response:
        h = core.health()
        return JSONResponse(h.model_dump(), status_code=200 if h.status == "ok" else 503)

    @r.get("/metrics")
    async def metrics() -> Response:
        return Response(core.metrics.render(), media_type="text/plain; version=0.0.4")

    return r


def native_router(core: SamplerCore) -> APIRouter:
    r = APIRouter(prefix="/v1", tags=["sampling"])

    @r.post("/sample", response_model=SampleResponse)
    async def sample(req: SampleRequest) -> SampleResponse:
        return await core.sample(req)

    @r.post("/sample/submit", response_model=SubmitResponse)
    async def submit(req: SampleRequest) -> SubmitResponse:
        return SubmitResponse(request_id=core.submit(req))

    @r.post("/sample/retrieve", response_model=SampleResponse,
            responses={202: {"description": "still running: retrieve again"}})
    async def retrieve(req: RetrieveRequest) -> Any:
        done, result = await core.futures.retrieve(req.request_id, req.wait_s)
        if not done:
            return JSONResponse({"status": "pending", "request_id": req.request_id}, status_code=202)
        return result

    return r
