"""Plain snapshots of kopf's views of an object.

kopf hands handlers and daemons its objects as views (`kopf.Body`, `kopf.Spec`, ...). A daemon's body is
a *live* view: kopf updates it in place at every watch event, so a coroutine that reads it before and
after an `await` may read two versions of the object. The replica loop's step awaits probes and loads;
it works on a snapshot taken at its start (reconcile.step), and the pure modules take plain dicts.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def plain(value: Any) -> Any:
    """`value` (kopf's views, or plain data) as plain dicts and lists, copied: later changes to the view
    do not reach it."""
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value
