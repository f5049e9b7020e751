"""`GET /v1/pool/peer/readings?after=SEQ&epoch=E&wait_s=W`: this gateway's `/health` reads, for the
pool's other gateways (discovery/peers.py: each replica is read by one gateway, which serves the read
to the others). A long poll: answered at once with the reads newer than SEQ (all of them when E is
not this process's epoch), else at the next read, else after W seconds (at most 30) with none. 404
when this gateway shares no reads. Behind the pool's API key, as the sampling routes."""

from __future__ import annotations

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response

from sampler_common.errors import InvalidRequest, NotFound

from ..discovery.peers import PATH, Board

router = APIRouter(tags=["pool"])

MAX_WAIT_S = 30.0


@router.get(PATH, include_in_schema=False)
async def readings(request: Request, after: int = 0, epoch: str = "", wait_s: float = 10.0) -> Response:
    board: Board | None = request.app.state.board
    if board is None:
        raise NotFound("this gateway shares no /health reads (static discovery, sharing off, or no peer address)")
    if after < 0:
        raise InvalidRequest("after must be >= 0", field="after")
    if not 0 <= wait_s <= MAX_WAIT_S:
        raise InvalidRequest(f"wait_s must be within [0, {MAX_WAIT_S:g}]", field="wait_s")
    return Response(orjson.dumps(await board.wait(after, epoch or None, wait_s)), media_type="application/json")
