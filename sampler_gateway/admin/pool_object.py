"""The SamplerPool object the admin routes read and write, behind a two-method port.

`kube` discovery has a pool object on the API server (`KubePoolObject`); `static` discovery has none
(`None`: the admin routes answer 404 saying so). Reads go to the API server, not to the discovery's
watch cache: a push is checked against the object it then writes (its resourceVersion), and a
rollout read just after a push must see that push. Both are rare (a trainer's step), so the extra
round trip costs nothing that matters. The blocking kubernetes client runs in a thread.

A rollout read may wait for the pool's next write (`changed`: a watch of the one pool from the
resourceVersion the reader last saw), so a trainer waiting for its push learns of each step when the
operator writes it, not at its next poll.

RBAC: get and watch (the discovery's Role has them) and patch on this one pool only (`resourceNames`,
operator/sampler_operator/pool/gateway.py).
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from sampler_common.errors import Conflict, InvalidRequest, NotFound, SamplerError

from ..kube.client import load_kube_config

if TYPE_CHECKING:
    from .adapter_acks import KubeAdapterAcks

GROUP, VERSION, PLURAL = "sampler.rl.dev", "v1alpha1", "samplerpools"


class PoolApiError(SamplerError):
    """The API server refused the gateway's read or write for another reason (its RBAC, say)."""

    status_code = 502
    category = "pool_api"


class StaleRead(Conflict):
    """The pool changed between the read a write was checked against and the write (409 on its
    resourceVersion). Mostly the operator's own status writes during a rollout: the push route
    reads and checks again (`routes/pool.py`) before this reaches a trainer."""


class PoolObject(Protocol):
    async def read(self) -> dict[str, Any]: ...

    async def patch(self, body: dict[str, Any]) -> dict[str, Any]: ...

    async def changed(self, after: str, timeout_s: float) -> dict[str, Any] | None:
        """Return once the pool has a resourceVersion other than `after` (or may have: a watch that
        cannot start from `after` returns at once), or after `timeout_s`: the pool as the change
        left it when the change says (a watch event), else None (the caller reads it)."""

    async def gateways_behind(self, serial: int, timeout_s: float) -> list[str]:
        """Wait until every live gateway of the pool routes by declared adapters up to `serial`, at
        most `timeout_s`; the gateways still behind then ([]: none). adapter_acks.py."""


async def write_checked(obj: PoolObject, patch_of: Callable[[dict[str, Any]], dict[str, Any]],
                        attempts: int) -> dict[str, Any]:
    """Read the pool, build the patch from what was read (it carries that read's resourceVersion: checked
    against the very object it writes), write it; read and build again when the pool changed in between
    (`StaleRead`: mostly the operator's own status writes during a rollout), up to `attempts` writes.
    The pool as written."""
    for _ in range(attempts - 1):
        try:
            return await obj.patch(patch_of(await obj.read()))
        except StaleRead:
            continue
    return await obj.patch(patch_of(await obj.read()))


def _api_error(pool: str, namespace: str, status: int, reason: str, body: str | None) -> SamplerError:
    """An API server refusal as the gateway's answer: its own message, with the status it maps to."""
    try:
        message = str(json.loads(body or "{}").get("message") or reason)
    except (ValueError, AttributeError):
        message = reason
    if status == 404:
        return NotFound(f"SamplerPool {pool} not found in namespace {namespace}", field="pool")
    if status == 409:
        return StaleRead(f"SamplerPool {pool} changed while this push was checked; push again: {message}",
                         field="pool")
    if status == 422:
        return InvalidRequest(f"the API server refused the pool's new weights: {message}", field="body")
    return PoolApiError(f"the API server answered {status} for SamplerPool {pool}: {message}", field="pool")


class KubePoolObject:
    def __init__(self, pool: str, namespace: str) -> None:
        from kubernetes import client

        load_kube_config()
        self.pool, self.namespace = pool, namespace
        self._api = client.CustomObjectsApi()
        self._acks: KubeAdapterAcks | None = None  # made at the first LoRA push

    async def read(self) -> dict[str, Any]:
        return await asyncio.to_thread(self._call, self._api.get_namespaced_custom_object)

    async def patch(self, body: dict[str, Any]) -> dict[str, Any]:
        # A merge patch: `null` removes a field (a manifest or step the new push does not have).
        return await asyncio.to_thread(self._call, self._api.patch_namespaced_custom_object, body,
                                       _content_type="application/merge-patch+json")

    async def changed(self, after: str, timeout_s: float) -> dict[str, Any] | None:
        return await asyncio.to_thread(self._watch_from, after, timeout_s)

    async def gateways_behind(self, serial: int, timeout_s: float) -> list[str]:
        if self._acks is None:
            from ..routing.switch import label_value
            from .adapter_acks import KubeAdapterAcks

            self._acks = KubeAdapterAcks(label_value(self.pool), self.namespace)
        return await self._acks.behind(serial, timeout_s)

    def _watch_from(self, after: str, timeout_s: float) -> dict[str, Any] | None:
        """A watch of this one pool from `after`: its first event is the next write (a status write
        of the operator, a push), so a rollout read waits on the API server's own notice of a change
        instead of a client's fixed polls, and that event's object is the pool after it (no read
        more: the operator's last status write of a rollout reaches the trainer one round trip
        sooner). Any failure (a version too old to watch from: 410) ends the wait with None: the
        caller reads the pool again, which is never wrong."""
        from kubernetes import watch

        w = watch.Watch()
        try:
            for event in w.stream(self._api.list_namespaced_custom_object, GROUP, VERSION, self.namespace, PLURAL,
                                  field_selector=f"metadata.name={self.pool}", resource_version=after,
                                  timeout_seconds=max(1, math.ceil(timeout_s)), _request_timeout=timeout_s + 5):
                obj = event.get("object")
                if event.get("type") in ("ADDED", "MODIFIED") and isinstance(obj, dict) and obj.get("spec") is not None:
                    return obj
                return None
        except Exception:  # the read that follows tells the caller what the pool is
            pass
        finally:
            w.stop()
        return None

    def _call(self, fn: Any, *body: dict[str, Any], **options: Any) -> dict[str, Any]:
        from kubernetes.client.exceptions import ApiException

        try:
            out: dict[str, Any] = fn(GROUP, VERSION, self.namespace, PLURAL, self.pool, *body, **options)
        except ApiException as e:
            raise _api_error(self.pool, self.namespace, int(e.status or 0), str(e.reason), e.body) from None
        return out
