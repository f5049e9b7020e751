"""vLLM's weight-transfer control routes, at vLLM's own paths and with vLLM's bodies (its
`entrypoints/rl/online/api_router.py`), so vLLM's `HTTPVLLMWeightSyncClient` drives a replica unchanged.
Thin HTTP over `WeightTransferService` (weights/transfer.py).

The control routes sit on `admin_router` (the admin key: `create_app`), `/get_world_size` on `router` (a
read). Every call runs in its own shielded task, as a checkpoint load does: a trainer that hangs up (or
dies) mid-push must not cancel the replica's half of it, which ends by itself and leaves nothing behind.
"""

from __future__ import annotations

import asyncio
from enum import Enum
from typing import Any

from fastapi import APIRouter, Request

from ...protocols.common import ADMIN_RESPONSES
from ...weights.transfer import (
    FinishRequest,
    FinishResponse,
    InitRequest,
    InitResponse,
    TransferAnswer,
    UpdateRequest,
    UpdateResponse,
    WeightTransferService,
    WorldSize,
)

TAGS: list[str | Enum] = ["weight transfer"]
_CONFLICT: dict[int | str, dict[str, Any]] = {409: {
    "description": "`conflict`: the call is out of order (field: the call), e.g. `update_weights` before "
                   "`start_weight_update`; nothing changed"}}
_NOT_ENABLED = "`invalid_request` (field `backend`): the replica was started without --weight-transfer-backend"
router = APIRouter(tags=TAGS)
admin_router = APIRouter(tags=TAGS, responses={**ADMIN_RESPONSES, **_CONFLICT})


def _service(request: Request) -> WeightTransferService:
    service: WeightTransferService = request.app.state.transfer
    return service


@admin_router.post("/init_weight_transfer_engine", response_model=InitResponse, responses={
    400: {"description": f"{_NOT_ENABLED}; or a field of `init_info` (an unknown `backend`, a `world_size` "
                         "with no room for this replica at `rank_offset`)"},
    502: {"description": "`transfer_failed`: the trainer's group could not be joined (field "
                         "`init_info.master_address`)"}})
async def init_weight_transfer_engine(req: InitRequest, request: Request) -> InitResponse:
    return await asyncio.shield(asyncio.ensure_future(_service(request).init(req.init_info)))


@admin_router.post("/start_weight_update", response_model=TransferAnswer)
async def start_weight_update(request: Request) -> TransferAnswer:
    return await asyncio.shield(asyncio.ensure_future(_service(request).start()))


@admin_router.post("/update_weights", response_model=UpdateResponse, responses={
    400: {"description": "`invalid_checkpoint`: a tensor that is not the served model's, or has another shape "
                         "or dtype, or a sha256 that differs from the sender's (each names the tensor and the "
                         "field); nothing was written and the replica left the group"},
    502: {"description": "`transfer_failed`: the push tore (the trainer died, a timeout); nothing was written"}})
async def update_weights(req: UpdateRequest, request: Request) -> UpdateResponse:
    return await asyncio.shield(asyncio.ensure_future(_service(request).update(req.update_info)))


@admin_router.post("/finish_weight_update", response_model=FinishResponse, responses={
    504: {"description": "`load_timeout`: the samples in flight did not drain within `timeout_s`; nothing was "
                         "written"},
    500: {"description": "`weight_write_failed`: the write failed midway; the weights are uncertain"}})
async def finish_weight_update(request: Request, req: FinishRequest | None = None) -> FinishResponse:
    # vLLM's client sends no body at all when it names no weight_version.
    return await asyncio.shield(asyncio.ensure_future(_service(request).finish(req or FinishRequest())))


@admin_router.post("/shutdown_weight_transfer_engine", response_model=TransferAnswer)
async def shutdown_weight_transfer_engine(request: Request) -> TransferAnswer:
    return await asyncio.shield(asyncio.ensure_future(_service(request).shutdown()))


@router.get("/get_world_size", response_model=WorldSize)
async def get_world_size(request: Request, include_dp: bool = True) -> WorldSize:
    """The ranks this replica takes in a transfer group (vLLM's route; a trainer adds its own rank). A
    replica is one data-parallel rank, so `include_dp` changes nothing."""
    return _service(request).world_size()
