"""Checkpoint and adapter routes: thin HTTP over `WeightsService`."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Response

from .core import SamplerCore
from .weights import AddAdapterRequest, AdapterInfo, LoadCheckpointRequest, LoadCheckpointResponse, WeightsService


def weights_router(core: SamplerCore) -> APIRouter:
    service = WeightsService(core)
    core.weights_service = service  # type: ignore[attr-defined]
    r = APIRouter(prefix="/v1", tags=["weights"])

    @r.post("/checkpoints/load", response_model=LoadCheckpointResponse)
    async def load_checkpoint(req: LoadCheckpointRequest) -> LoadCheckpointResponse:
        # Shielded: a client that hangs up must not cancel a write halfway.
        return await asyncio.shield(asyncio.ensure_future(service.load_checkpoint(req)))

    @r.get("/adapters", response_model=list[AdapterInfo])
    async def list_adapters() -> list[AdapterInfo]:
        return service.list_adapters()

    @r.post("/adapters", response_model=AdapterInfo)
    async def add_adapter(req: AddAdapterRequest) -> AdapterInfo:
        return await asyncio.shield(asyncio.ensure_future(service.add_adapter(req)))

    @r.delete("/adapters/{name}", status_code=204)
    async def remove_adapter(name: str) -> Response:
        await asyncio.shield(asyncio.ensure_future(service.remove_adapter(name)))
        return Response(status_code=204)

    return r
