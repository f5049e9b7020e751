"""Every failure a client can see, each with one HTTP status and a stable category.

Routes never build error bodies by hand: they raise a `SamplerError` and the app's
exception handler renders `{"error": {"category", "message", "field"}}`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ValidationError


class SamplerError(Exception):
    status_code: int = 500
    category: str = "internal"

    def __init__(self, message: str, *, field: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        err: dict[str, Any] = {"category": self.category, "message": self.message}
        if self.field is not None:
            err["field"] = self.field
        return {"error": err}


class InvalidRequest(SamplerError):
    status_code = 400
    category = "invalid_request"


class BodyTooLarge(SamplerError):
    status_code = 413
    category = "body_too_large"


class Unauthorized(SamplerError):
    status_code = 401
    category = "unauthorized"


class Forbidden(SamplerError):
    """A valid key that may not do this: the sampling key on a weight or adapter change."""

    status_code = 403
    category = "forbidden"


class NotFound(SamplerError):
    status_code = 404
    category = "not_found"


class Expired(SamplerError):
    """A future id we issued but no longer hold (retrieved already, or past its TTL)."""

    status_code = 410
    category = "expired"


class Overloaded(SamplerError):
    status_code = 429
    category = "overloaded"

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message, headers={"Retry-After": str(retry_after_s)})
        self.retry_after_s = retry_after_s


class RequestTimedOut(SamplerError):
    status_code = 504
    category = "timeout"


class UncertainWeights(SamplerError):
    """The replica's weights are not known to be what any checkpoint says: it must not serve."""

    status_code = 503
    category = "uncertain_weights"


class EngineUnavailable(SamplerError):
    status_code = 503
    category = "engine_unavailable"


class Aborted(SamplerError):
    """Stopped mid-generation by a weights load in abort mode (`in_flight: "abort"`). Nothing is wrong
    with the request: resubmitted, it queues behind the load and runs on the new weights."""

    status_code = 503
    category = "aborted"

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"Retry-After": "1"})


class EngineFailure(SamplerError):
    status_code = 500
    category = "engine_error"


class LoadTimedOut(SamplerError):
    status_code = 504
    category = "load_timeout"


class Conflict(SamplerError):
    status_code = 409
    category = "conflict"


def validation_error(e: ValidationError, prefix: str = "") -> InvalidRequest:
    """A pydantic error as our 400 (see `first_invalid`)."""
    return first_invalid(e.errors(), prefix)


def first_invalid(details: Sequence[Mapping[str, Any]], prefix: str = "") -> InvalidRequest:
    """The first of pydantic's error details as our 400, naming the field the way the client
    wrote it: `sampling_params.top_p`, `prompts[0][3]`; `body` when there is no field to name."""
    first = details[0]
    if first.get("type") == "json_invalid":
        # Not valid JSON at all (FastAPI puts the character offset in `loc`): the body is at fault.
        field = prefix.rstrip(".") or "body"
        return InvalidRequest(f"{field}: {first.get('msg')}: {first.get('ctx', {}).get('error', '')}".rstrip(": "),
                              field=field)
    loc = [p for p in first.get("loc", ()) if p != "body"]
    field = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
    field = f"{prefix}{field}" if field else (prefix.rstrip(".") or "body")
    return InvalidRequest(f"{field}: {first.get('msg')}", field=field)
