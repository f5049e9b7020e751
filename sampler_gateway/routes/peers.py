"""`GET /v1/pool/peer/readings?after=SEQ&epoch=E&wait_s=W`: this gateway's `/health` reads, for the
pool's other gateways (discovery/peers.py: each replica is read by one gateway, which serves the read
to the others). A long poll: answered at once with the reads newer than SEQ (all of them when E is
not this process's epoch), else at the next read, else after W seconds (at most 30) with none. A bad
value is a 400 naming it; 404 when this gateway shares no reads. Behind the pool's API key, as the
sampling routes."""

from __future__ import annotations

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sampler_common.errors import NotFound, validation_error

from ..discovery.peers import PATH, WAIT_S, Board

router = APIRouter(tags=["pool"])


class ReadingsQuery(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    after: int = Field(0, ge=0, description="the sequence number of the last reading taken")
    epoch: str = Field("", max_length=64, description="the epoch of the answer that number came from")
    wait_s: float = Field(WAIT_S, ge=0.0, le=30.0, description="seconds to wait for a newer reading")


@router.get(PATH, include_in_schema=False)
async def readings(request: Request) -> Response:
    board: Board | None = request.app.state.board
    if board is None:
        raise NotFound("this gateway shares no /health reads (static discovery, sharing off, or no peer address)")
    try:
        q = ReadingsQuery.model_validate(dict(request.query_params))
    except ValidationError as e:
        raise validation_error(e) from None
    return Response(orjson.dumps(await board.wait(q.after, q.epoch or None, q.wait_s)), media_type="application/json")
