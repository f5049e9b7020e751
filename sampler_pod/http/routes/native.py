"""The native sampling API: `/v1/sample` (wait for the result) and submit/retrieve/wait/cancel (futures)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ...core.schemas import (
    CancelRequest,
    CancelResponse,
    RetrieveRequest,
    SampleRequest,
    SampleResponse,
    SubmitResponse,
    WaitRequest,
    WaitResponse,
)
from . import core_of

router = APIRouter(prefix="/v1", tags=["sampling"])


@router.post("/sample", response_model=SampleResponse)
async def sample(req: SampleRequest, request: Request) -> SampleResponse:
    # A client that disconnects cancels this handler (sampler_common/http/middleware.py), which aborts the request.
    return await core_of(request).sample(req)


@router.post("/sample/submit", response_model=SubmitResponse)
async def submit(req: SampleRequest, request: Request) -> SubmitResponse:
    return SubmitResponse(request_id=core_of(request).submit(req))


@router.post("/sample/retrieve", response_model=SampleResponse,
             responses={202: {"description": "still running: retrieve again"}})
async def retrieve(req: RetrieveRequest, request: Request) -> Any:
    done, result = await core_of(request).futures.retrieve(req.request_id, req.wait_s)
    if not done:
        return JSONResponse({"status": "pending", "request_id": req.request_id}, status_code=202)
    return result


@router.post("/sample/wait", response_model=WaitResponse)
async def wait(req: WaitRequest, request: Request) -> WaitResponse:
    """Long-poll until a future has ended (or wait_s passed), leaving its result for retrieve: a pool's
    gateway holds the future's place in its fair admission until then. Native and Tinker futures alike."""
    return WaitResponse(request_id=req.request_id, done=await core_of(request).futures.wait(req.request_id, req.wait_s))


@router.post("/sample/cancel", response_model=CancelResponse)
async def cancel(req: CancelRequest, request: Request) -> CancelResponse:
    """Drop a future; a running one aborts its engine calls (its slot is freed once the engine lets go)."""
    return CancelResponse(request_id=req.request_id, was_running=core_of(request).futures.cancel(req.request_id))
