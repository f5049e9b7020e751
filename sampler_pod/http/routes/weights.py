"""Checkpoint and adapter routes: thin HTTP over `WeightsService` (and `DigestLoads` for a load that names
its weights by digest); the kept copy of pushed weights a peer catches up from (weights/peer_copy.py).

Mutations sit on `admin_router` (`create_app` guards it with the admin key, `sampler_common/http/auth.py`), reads
on `router`. Every mutation runs in its own shielded task: a client that hangs up must not cancel a
weight write halfway (that would leave the weights uncertain for no reason).
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import StreamingResponse

from sampler_common.errors import NotFound

from ...protocols.common import ADMIN_RESPONSES
from ...weights import peer_copy
from ...weights.digest_load import DigestLoads
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


@admin_router.post("/checkpoints/load", response_model=LoadCheckpointResponse, responses={409: {
    "description": "`weights_unavailable` (field `sha256`): a load by digest found the weights nowhere (no push "
                   "held, no kept copy, no peer that has them, no `path`); nothing was written"}})
async def load_checkpoint(req: LoadCheckpointRequest, request: Request) -> LoadCheckpointResponse:
    loads: DigestLoads = request.app.state.digest_loads
    return await asyncio.shield(asyncio.ensure_future(loads.load(req)))


@admin_router.get(peer_copy.PATH.removeprefix("/v1"), response_class=StreamingResponse, responses={
    200: {"content": {peer_copy.MEDIA_TYPE: {}},
          "description": "the kept copy as one safetensors file (its `__metadata__` names sha256, label, step)"},
    404: {"description": "`not_found` (field `sha256`): this replica keeps no copy of those weights"}})
async def kept_weights(request: Request, sha256: str = Query(..., pattern=r"^[0-9a-fA-F]{64}$")) -> Response:
    """The weights this replica keeps after writing a push over the network (or a catch-up), for a peer's
    catch-up: what a load `{"sha256", "peers": [this replica]}` reads."""
    core = request.app.state.core
    engine = core.require_engine()
    kept = await engine.kept()
    digest = sha256.lower()
    if kept is None or kept.sha256 != digest:
        has = f"it keeps {kept.sha256}" if kept is not None else "it keeps none"
        raise NotFound(f"sha256: this replica keeps no copy of the weights of {digest} ({has})", field="sha256")
    w = core.weights
    label, step = (w.label, w.step) if w.sha256 == digest else (None, None)
    return StreamingResponse(peer_copy.stream_kept(engine, kept, label, step), media_type=peer_copy.MEDIA_TYPE,
                             headers={"Content-Length": str(peer_copy.stream_length(kept, label, step)),
                                      "X-Sampler-Weights-Sha256": digest,
                                      "Content-Disposition": 'attachment; filename="model.safetensors"'})


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
