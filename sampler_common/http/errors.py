"""How errors leave the server: every failure as `{"error": {category, message, field}}`.

Routes never build error bodies: they raise a `SamplerError`, and the handlers here render it.
So do the framework's own errors (a body FastAPI cannot parse, an unknown route, a wrong method)
and any unexpected exception (a 500 `internal`, never a plain-text page).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from ..errors import SamplerError, first_invalid

log = logging.getLogger(__name__)

# The framework's own HTTP errors: (category, field) by status.
_HTTP_ERRORS: dict[int, tuple[str, str | None]] = {
    400: ("invalid_request", "body"),
    404: ("not_found", "path"),
    405: ("method_not_allowed", "method"),
    413: ("body_too_large", "body"),
}


def error_response(e: SamplerError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status_code, headers=e.headers)


def _http_error(e: HTTPException) -> JSONResponse:
    category, field = _HTTP_ERRORS.get(e.status_code, (f"http_{e.status_code}", None))
    message = str(e.detail)
    cause = e.__cause__
    if e.status_code == 400 and cause is not None:
        # FastAPI's "There was an error parsing the body" hides why: invalid UTF-8, nesting deeper
        # than the parser's recursion limit, an integer with too many digits, ...
        message = f"the request body could not be parsed: {type(cause).__name__}: {cause}"[:500]
    err: dict[str, str] = {"category": category, "message": message}
    if field is not None:
        err["field"] = field
    return JSONResponse({"error": err}, status_code=e.status_code, headers=e.headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(SamplerError)
    async def _sampler_error(_req: Request, e: SamplerError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _validation(_req: Request, e: RequestValidationError) -> JSONResponse:
        return error_response(first_invalid(e.errors()))

    @app.exception_handler(HTTPException)
    async def _framework(_req: Request, e: HTTPException) -> JSONResponse:
        return _http_error(e)

    @app.exception_handler(Exception)
    async def _unexpected(req: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", req.method, req.url.path)
        return error_response(SamplerError(f"internal error: {type(e).__name__}"))
