"""How errors leave the server: every failure as `{"error": {category, message, field}}`.

Routes never build error bodies: they raise a `SamplerError`, and the handlers here render it.
The body limit lives here too, because an over-limit body is refused before any route runs.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from ..errors import BodyTooLarge, SamplerError, first_invalid


def error_response(e: SamplerError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status_code, headers=e.headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(SamplerError)
    async def _sampler_error(_req: Request, e: SamplerError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _validation(_req: Request, e: RequestValidationError) -> JSONResponse:
        return error_response(first_invalid(e.errors()))


class BodyLimitMiddleware:
    """Refuse bodies over the limit before they are read into memory (413 naming `body`)."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_big = BodyTooLarge(f"request body is over {self.max_bytes} bytes", field="body")
        for k, v in scope.get("headers", []):
            if k == b"content-length" and v.isdigit() and int(v) > self.max_bytes:
                await error_response(too_big)(scope, receive, send)
                return
        seen = 0

        async def limited_receive() -> Any:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    raise too_big
            return msg

        try:
            await self.app(scope, limited_receive, send)
        except BodyTooLarge as e:
            await error_response(e)(scope, receive, send)
