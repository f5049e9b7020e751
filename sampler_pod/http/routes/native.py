"""The native sampling API: `/v1/sample` (wait for the result) and submit/retrieve/wait/cancel (futures)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Header, Request
from fastapi.responses import JSONResponse

from ...core import logprobs_mode
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

# The mode the client expects, as a header (any protocol's client can send one): refused with a 400 naming
# it when the replica serves another. A string, so a wrong value is our 400 naming the header.
ExpectedMode = Annotated[str | None, Header(
    alias=logprobs_mode.HEADER, json_schema_extra={"enum": list(logprobs_mode.MODES)},
    description="the logprobs mode the client expects (as the body's logprobs_mode)")]


@router.post("/sample", response_model=SampleResponse)
async def sample(req: SampleRequest, request: Request, expected: ExpectedMode = None) -> SampleResponse:
    core = core_of(request)
    logprobs_mode.check_expected_header(expected, core.cfg.logprobs_mode)
    # A client that disconnects cancels this handler (sampler_common/http/middleware.py), which aborts the request.
    return await core.sample(req)


@router.post("/sample/submit", response_model=SubmitResponse)
async def submit(req: SampleRequest, request: Request, expected: ExpectedMode = None) -> SubmitResponse:
    core = core_of(request)
    logprobs_mode.check_expected_header(expected, core.cfg.logprobs_mode)
    return SubmitResponse(request_id=core.submit(req))


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
