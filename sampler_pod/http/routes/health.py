"""Probes and metrics: open (no API key), because the kubelet and the operator call them.

`/healthz` is liveness (only a dead engine fails it), `/readyz` readiness (only `ok` passes),
`/startedz` the kubelet's startup probe (the start-up is over: serving, or waiting for a checkpoint
it can load, which a restart would not bring), `/health` the full report the operator acts on.
See docs/reference/contract.md.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ...core.health import liveness_ok, startup_finished
from . import core_of

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz(request: Request) -> Response:
    status = core_of(request).health().status
    return JSONResponse({"alive": liveness_ok(status), "status": status},
                        status_code=200 if liveness_ok(status) else 503)


@router.get("/readyz")
async def readyz(request: Request) -> Response:
    h = core_of(request).health()
    return JSONResponse({"ready": h.status == "ok", "status": h.status, "reason": h.reason},
                        status_code=200 if h.status == "ok" else 503)


@router.get("/startedz")
async def startedz(request: Request) -> Response:
    h = core_of(request).health()
    started = startup_finished(h.status, h.reason)
    return JSONResponse({"started": started, "status": h.status, "reason": h.reason},
                        status_code=200 if started else 503)


@router.get("/health")
async def health(request: Request) -> Response:
    h = core_of(request).health()
    return JSONResponse(h.model_dump(), status_code=200 if h.status == "ok" else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(core_of(request).metrics.render(), media_type="text/plain; version=0.0.4")
