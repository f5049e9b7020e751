"""API-key authentication, applied once in `create_app` to every router except the probes.

The key may come as `X-API-Key` or `Authorization: Bearer` (what the Tinker SDK and Twinkle's
client send). With no key configured the server is open: for local runs and tests only; the
operator always configures one in a cluster.
"""

from __future__ import annotations

import hmac

from fastapi import Request

from ..errors import Unauthorized


class APIKeyAuth:
    """A FastAPI dependency: `Depends(APIKeyAuth(key))` on a router guards all its routes."""

    def __init__(self, api_key: str | None) -> None:
        self._key = api_key.encode() if api_key is not None else None

    def __call__(self, request: Request) -> None:
        if self._key is None:
            return
        given = request.headers.get("x-api-key") or ""
        auth = request.headers.get("authorization") or ""
        if auth.lower().startswith("bearer "):
            given = given or auth[7:]
        # Constant-time comparison: no timing oracle on the key.
        if not hmac.compare_digest(given.encode(), self._key):
            raise Unauthorized("missing or wrong API key (X-API-Key or Authorization: Bearer)")
