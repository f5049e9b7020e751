"""Checkpoint and adapter routes: thin HTTP over `WeightsService`.

Mutations sit on `admin_router` (`create_app` guards it with the admin key, `sampler_common/http/auth.py`), reads
on `router`. Every mutation runs in its own shielded task: a client that hangs up must not cancel a
weight write halfway (that would leave the weights uncertain for no reason).
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request, Response

from ...protocols.common import ADMIN_RESPONSES
from ...weights.service import (
    AdapterInfo,
    AddAdapterRequest,
    LoadCheckpointRequest,
    LoadCheckpointResponse,
    WeightsService,
)

router = APIRouter(prefix="/v1", tags=["weights"])
# What changes the weights or adapters: the admin key's routes (when --admin-api-key is set).
admin_router = APIRouter(prefix="/v1", tags=["weights"], responses=ADMIN_RESPONSES)


def _service(request: Request) -> WeightsService:
    service: WeightsService = request.app.state.weights
    return service


@admin_router.post("/checkpoints/load", response_model=LoadCheckpointResponse)
async def load_checkpoint(req: LoadCheckpointRequest, request: Request) -> LoadCheckpointResponse:
    return await asyncio.shield(asyncio.ensure_future(_service(request).load_checkpoint(req)))


@router.get("/adapters", response_model=list[AdapterInfo])
async def list_adapters(request: Request) -> list[AdapterInfo]:
    return _service(request).list_adapters()


@admin_router.post("/adapters", response_model=AdapterInfo, responses={409: {
    "description": "`conflict`: an adapter of that name is loaded (field `name`), or the server holds as many "
                   "adapters as --max-cpu-loras allows (field `max_cpu_loras`); nothing was loaded"}})
async def add_adapter(req: AddAdapterRequest, request: Request) -> AdapterInfo:
    return await asyncio.shield(asyncio.ensure_future(_service(request).add_adapter(req)))


@admin_router.delete("/adapters/{name}", status_code=204, responses={409: {
    "description": "`conflict` (field `name`): the adapter has requests in flight; nothing was unloaded"}})
async def remove_adapter(name: str, request: Request) -> Response:
    await asyncio.shield(asyncio.ensure_future(_service(request).remove_adapter(name)))
    return Response(status_code=204)
