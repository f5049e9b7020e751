"""The gateway's own probes and metrics (open, like a replica's): `/healthz` liveness (the process
serves), `/readyz` ready iff some replica may take a new request now, `/health` the whole view."""

from __future__ import annotations

from dataclasses import asdict

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from .common import gateway_of

router = APIRouter(tags=["health"])


@router.get("/healthz")
@router.get("/api/v1/healthz")
@router.get("/api/v1/twinkle/healthz")
async def healthz() -> Response:
    return JSONResponse({"alive": True, "status": "ok"})


@router.get("/readyz")
async def readyz(request: Request) -> Response:
    pool = gateway_of(request).pool
    eligible = pool.eligible()
    return JSONResponse({"ready": bool(eligible), "eligible": [r.name for r in eligible],
                         "reason": None if eligible else pool.why_none()}, status_code=200 if eligible else 503)


@router.get("/health")
async def health(request: Request) -> Response:
    gw = gateway_of(request)
    pool = gw.pool
    eligible = {r.name for r in pool.eligible()}
    return JSONResponse({
        "status": "ok" if eligible else "no_replica", "pool": gw.cfg.pool, "version_policy": gw.cfg.version_policy,
        "target_label": pool.target, "min_label": pool.min_label, "newest_returned": pool.order.newest_returned,
        "labels": sorted(pool.order.ranks, key=pool.order.ranks.__getitem__),
        "replicas": [{**asdict(r), "eligible": r.name in eligible, "in_flight": pool.in_flight.get(r.name, 0)}
                     for r in pool.view.replicas],
        "refreshes": pool.refreshes,
        # The pool's routing switch as this gateway enforces it (routing/switch.py); null: no switch (static).
        "routing": pool.switch.state() if pool.switch is not None else None,
        # A push over the network through this gateway (admin/transfer.py): its phase and replicas.
        "weight_transfer": request.app.state.transfer.report() if hasattr(request.app.state, "transfer") else None,
    }, status_code=200 if eligible else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(gateway_of(request).metrics.render(), media_type="text/plain; version=0.0.4")
