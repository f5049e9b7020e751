"""The errors of the trainer's side of a pool: a leaf that `pool` and `weight_transfer` both raise, so
neither imports the other for them."""

from __future__ import annotations


class PoolError(Exception):
    """Anything this client could not do; subclasses say what."""


class RequestRefused(PoolError):
    """The gateway answered an error: `status`, and the error's `category`, `field` and `message`."""

    def __init__(self, status: int, category: str, message: str, field: str | None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(f"{status} {category}" + (f" ({field})" if field else "") + f": {message}")
        self.status, self.category, self.message, self.field = status, category, message, field
        self.retry_after_s = retry_after_s  # the answer's Retry-After, when it had one

    @property
    def transient(self) -> bool:
        """A 429, or a 503 but for gateways behind: the same call may succeed in a moment (the pool
        busy or changing). A gateway that did not route by a push within its Lease bound will not in
        the next moment either: that 503 (field `gateways`) is the caller's to judge."""
        return self.status == 429 or (self.status == 503 and self.field != "gateways")
