"""vLLM's weight-transfer control routes on the pool's gateway, at vLLM's paths with vLLM's bodies, so the
trainer's single control plane is the pool's address (`HTTPVLLMWeightSyncClient` drives it unchanged,
`sampler_client`'s `Pool.push_weights` too). Thin HTTP over `admin/transfer.py`.

The five control calls take the pool's admin key (as `/v1/pool/*`, `PoolAdminAuth`: also as the password
of HTTP Basic, the one way vLLM's client can send one); `/get_world_size`, a read, the sampling key, as on a
replica. Every call runs in its own shielded task: a trainer that hangs up mid-push must not cancel the
pool's half of it halfway (a fan-out left half sent).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ..admin.transfer import PoolTransfer
from .common import json_object

router = APIRouter(tags=["weight transfer"])
admin_router = APIRouter(tags=["weight transfer"])


def _transfer(request: Request) -> PoolTransfer:
    transfer: PoolTransfer = request.app.state.transfer
    return transfer


async def _shielded(call: Any) -> Response:
    task = asyncio.ensure_future(call)
    return JSONResponse(await asyncio.shield(task))


async def _body(request: Request) -> dict[str, Any] | None:
    raw = await request.body()
    return json_object(raw) if raw.strip() else None


@router.get("/get_world_size")
async def get_world_size(request: Request, include_dp: bool = True) -> Response:
    """The ranks the pool's usable replicas (ready, whatever weights they serve) take now, summed (a trainer
    adds its own rank 0); by replica under `replicas`."""
    return await _shielded(_transfer(request).world_size())


@admin_router.post("/init_weight_transfer_engine")
async def init_weight_transfer_engine(request: Request) -> Response:
    return await _shielded(_transfer(request).init(await _body(request)))


@admin_router.post("/start_weight_update")
async def start_weight_update(request: Request) -> Response:
    return await _shielded(_transfer(request).start())


@admin_router.post("/update_weights")
async def update_weights(request: Request) -> Response:
    return await _shielded(_transfer(request).update(await _body(request)))


@admin_router.post("/finish_weight_update")
async def finish_weight_update(request: Request) -> Response:
    # vLLM's client sends no body at all when it names no weight_version.
    return await _shielded(_transfer(request).finish(await _body(request)))


@admin_router.post("/shutdown_weight_transfer_engine")
async def shutdown_weight_transfer_engine(request: Request) -> Response:
    return await _shielded(_transfer(request).shutdown())
