"""The pool's admin routes (admin key only): `POST /v1/pool/weights` sets the SamplerPool's
`spec.weights` (the operator rolls them out), `GET /v1/pool/rollout` tells how far that went (at once, or
once the pool changed: a long poll).
The decisions are `admin/weights.py`'s; the object is `pool_object.py`'s."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from sampler_common.errors import Forbidden, NotFound
from sampler_common.http.auth import APIKeyAuth

from ..admin.pool_object import PoolObject, write_checked
from ..admin.weights import parse_push, parse_rollout_wait, rollout_of, weights_patch
from .common import json_object

router = APIRouter(prefix="/v1/pool", tags=["pool"])

# How many times a push re-reads the pool when it changed under the write. The operator writes the
# pool's status many times per rollout, and each write moves its resourceVersion; a trainer pushing
# while the last rollout settles would otherwise be told to push again (client-go's RetryOnConflict
# does the same, with a similar bound).
PUSH_ATTEMPTS = 5


class PoolAdminAuth:
    """The admin key, and only it. Unlike a replica's routes, never the sampling key in its place
    when no admin key is configured: anyone who may sample would then choose the pool's weights.
    (No key at all: open, as the rest of the gateway; local runs and tests only.)"""

    def __init__(self, api_key: str | None, admin_api_key: str | None) -> None:
        self._auth = APIKeyAuth(api_key, admin_api_key)
        self._no_admin = admin_api_key is None and api_key is not None

    async def __call__(self, request: Request) -> None:
        if self._no_admin:
            await self._auth.sampling(request)  # a wrong key is still a 401
            raise Forbidden("this gateway has no admin key (SAMPLER_GATEWAY_ADMIN_API_KEY), so the pool's weights "
                            "cannot be changed or read through it")
        await self._auth.admin(request)


def _pool_object(request: Request) -> PoolObject:
    obj: PoolObject | None = request.app.state.pool_object
    if obj is None:
        raise NotFound("this gateway runs with --discovery static: there is no SamplerPool object to set weights "
                       "on or read a rollout from (run it with --discovery kube, as the operator does)", field="path")
    return obj


@router.post("/weights")
async def push_weights(request: Request) -> Response:
    obj = _pool_object(request)
    push = parse_push(json_object(await request.body()))
    # The push is checked against the very object it writes (its resourceVersion): a pool whose allowed
    # roots changed in between is refused on the next read, never passed on a stale one.
    return JSONResponse(rollout_of(await write_checked(obj, lambda pool: weights_patch(pool, push), PUSH_ATTEMPTS)))


@router.get("/rollout")
async def rollout(request: Request) -> Response:
    """With `?after=<resource_version>&wait_s=<s>`: a long poll, answered when the pool is no longer
    at that version (the operator wrote its status, a push came) or after `wait_s`."""
    wait = parse_rollout_wait(dict(request.query_params))
    obj = _pool_object(request)
    pool = await obj.read()
    if wait.waits and (pool.get("metadata") or {}).get("resourceVersion") == wait.after:
        assert wait.after is not None
        pool = await obj.changed(wait.after, wait.wait_s) or await obj.read()
    return JSONResponse(rollout_of(pool))
