"""API-key authentication, applied once in each server's `create_app`, by router: every router but the probes.

Two keys, two kinds of routes:
  * `--api-key` guards sampling and reads (`sampling`).
  * `--admin-api-key`, when set, guards what changes the replica's weights or adapters (`admin`): a
    trainer or the operator holds it; a sampling client cannot swap the weights others sample from.
    The admin key is accepted on every route (a trainer that loads weights also samples).
Without `--admin-api-key` both kinds take the API key, as before. A valid API key on an admin route
is a 403 (`forbidden`: the key is fine, the action is not), a missing or wrong key a 401.

The key may come as `X-API-Key` or `Authorization: Bearer` (what the Tinker SDK and Twinkle's
client send), or as the password of `Authorization: Basic` (any user name): what `requests` sends for a
URL `http://trainer:KEY@host:port`, the one way to give a key to a client that takes only a URL, such
as vLLM's `HTTPVLLMWeightSyncClient` (docs/guide/sampler.md, "Weights over the network").
With no key configured the routes are open: for local runs and tests only; the
operator always configures both keys in a cluster.

The gateway checks its own keys with the same class: `sampling` on every forwarded route, `admin`
under its stricter `/v1/pool/*` guard (`sampler_gateway/routes/pool.py`).
"""

from __future__ import annotations

import base64
import binascii
import hmac

from fastapi import Request

from ..errors import Forbidden, Unauthorized

_HOW = "X-API-Key, Authorization: Bearer, or the password of Authorization: Basic"


def _given(request: Request) -> bytes:
    given = (request.headers.get("x-api-key") or "").encode()
    auth = request.headers.get("authorization") or ""
    scheme, _, credentials = auth.partition(" ")
    if given or not credentials:
        return given
    if scheme.lower() == "bearer":
        return credentials.encode()
    if scheme.lower() == "basic":
        try:
            return base64.b64decode(credentials.strip(), validate=True).partition(b":")[2]
        except (binascii.Error, ValueError):
            return b""
    return b""


def _matches(given: bytes, key: bytes | None) -> bool:
    # Constant-time: no timing oracle on the key. An unset key matches nothing.
    return key is not None and hmac.compare_digest(given, key)


class APIKeyAuth:
    """Two FastAPI dependencies: `Depends(auth.sampling)` / `Depends(auth.admin)` on a router guard
    all its routes."""

    def __init__(self, api_key: str | None, admin_api_key: str | None = None) -> None:
        self._key = api_key.encode() if api_key is not None else None
        self._admin = admin_api_key.encode() if admin_api_key is not None else None

    # `async def`: FastAPI runs a plain `def` dependency in its thread pool, a thread hop on every
    # request for a few microseconds of work (it showed in the hot path's profile).
    async def sampling(self, request: Request) -> None:
        if self._key is None:
            return
        given = _given(request)
        # Both comparisons always run: the time taken does not tell which key was close.
        is_key, is_admin = _matches(given, self._key), _matches(given, self._admin)
        if not (is_key or is_admin):
            raise Unauthorized(f"missing or wrong API key ({_HOW})")

    async def admin(self, request: Request) -> None:
        if self._admin is None:
            await self.sampling(request)
            return
        given = _given(request)
        is_key, is_admin = _matches(given, self._key), _matches(given, self._admin)
        if is_admin:
            return
        if is_key:
            raise Forbidden("this API key may sample and read but not change weights or adapters: "
                            "use the admin key (--admin-api-key)")
        raise Unauthorized(f"missing or wrong admin API key ({_HOW})")
