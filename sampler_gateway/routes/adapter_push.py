"""`POST /v1/pool/adapters` (admin key, as the pool's other admin routes in `routes/pool.py`): declare
a run's adapter version in the SamplerPool and load it until servable. The decision is
`adapter_push.py`'s, the carrying out `admin/adapters.py`'s."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ..admin.adapter_push import parse_adapter_push
from ..admin.adapters import ReplicaAnswer, push_adapter
from ..kube.events import LOAD_FAILED
from ..lora.router import error_of
from .common import REPLICA_HEADER, gateway_of, json_object
from .pool import PUSH_ATTEMPTS, _pool_object

router = APIRouter(prefix="/v1/pool", tags=["pool"])


def _retrieved(task: asyncio.Future[Any]) -> None:
    """A push whose trainer went away ends unheard: its outcome is read, not logged as lost."""
    if not task.cancelled():
        task.exception()


async def shielded_push(request: Request, push: Coroutine[Any, Any, dict[str, Any]],
                        what: str) -> dict[str, Any] | Response:
    """Run a push to its end whatever the client does, as a replica shields its weight writes: a
    trainer that hangs up mid-push leaves no provisional copy loaded and no write half done. Its
    answer; or, when the validating replica refused the files, that replica's answer as it sent it
    (a 400 naming the file and tensor, and who sent it), also an Event on the pool naming `what`."""
    task = asyncio.ensure_future(push)
    task.add_done_callback(_retrieved)
    try:
        return await asyncio.shield(task)
    except ReplicaAnswer as e:
        gateway_of(request).events.warn(LOAD_FAILED, f"replica {e.replica} refused the push of {what}: "
                                                     f"{error_of(e.reply)[1]}")
        return Response(e.reply.body, status_code=e.reply.status, headers={REPLICA_HEADER: e.replica},
                        media_type=e.reply.header("content-type"))


@router.post("/adapters")
async def push(request: Request) -> Response:
    obj = _pool_object(request)
    body = parse_adapter_push(json_object(await request.body()))
    answer = await shielded_push(request, push_adapter(gateway_of(request), obj, body, PUSH_ATTEMPTS),
                                 f"run {body.run} step {body.step} ({body.version_label}, path {body.path})")
    return answer if isinstance(answer, Response) else JSONResponse(answer)
