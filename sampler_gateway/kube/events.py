"""Kubernetes Events the gateway posts on its SamplerPool: what only a gateway sees.

The operator posts the pool's Events about replicas and rollouts. Adapter loads are the gateways'
(a trainer's push, a request that needs a version a replica does not hold), so a load a replica
refuses (a deleted or corrupt adapter directory, a rank past `max_lora_rank`) would otherwise be
told only to the client that caused it. An Event on the pool tells the pool's owner:
`kubectl describe sp` lists it beside the operator's.

A failing load can repeat at every request for that version: an Event with the same reason and
message is posted at most once per `REPEAT_S` (the API server's own Event aggregation would count
them, at an API call each). Posting never blocks or fails the request: it runs in a thread, and a
refusal (a Role without `events: create`) is logged once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Protocol

log = logging.getLogger(__name__)

REPEAT_S = 60.0
# The reason of the Event for a load a replica refused, on demand or in a push.
LOAD_FAILED = "AdapterLoadFailed"
COMPONENT = "sampler-gateway"
POOL_API_VERSION, POOL_KIND = "sampler.rl.dev/v1alpha1", "SamplerPool"


class EventSink(Protocol):
    def warn(self, reason: str, message: str) -> None: ...


class NoEvents:
    """Static discovery: no pool object to post on."""

    def warn(self, reason: str, message: str) -> None:
        log.warning("%s: %s", reason, message)


class Throttle:
    """Whether an Event (reason, message) is due: not posted within the last `repeat_s` (pure but for
    the clock). Remembers at most `keep` distinct Events."""

    def __init__(self, repeat_s: float = REPEAT_S, clock: Callable[[], float] = time.monotonic,
                 keep: int = 256) -> None:
        self.repeat_s, self.clock, self.keep = repeat_s, clock, keep
        self._last: dict[tuple[str, str], float] = {}

    def due(self, reason: str, message: str) -> bool:
        now, key = self.clock(), (reason, message)
        last = self._last.get(key)
        if last is not None and now - last < self.repeat_s:
            return False
        if len(self._last) >= self.keep:
            self._last = {k: t for k, t in self._last.items() if now - t < self.repeat_s}
        self._last[key] = now
        return True


def event_body(pool: str, namespace: str, uid: str | None, reason: str, message: str, instance: str,
               now: datetime) -> dict[str, Any]:
    """A core/v1 Event on the SamplerPool (`uid` lets `kubectl describe sp` find it)."""
    stamp = now.isoformat(timespec="seconds").replace("+00:00", "Z")
    involved: dict[str, Any] = {"apiVersion": POOL_API_VERSION, "kind": POOL_KIND, "name": pool,
                                "namespace": namespace}
    if uid:
        involved["uid"] = uid
    return {"metadata": {"generateName": f"{pool}.", "namespace": namespace},
            "involvedObject": involved, "type": "Warning", "reason": reason, "message": message[:1024],
            "source": {"component": COMPONENT, "host": instance}, "reportingComponent": COMPONENT,
            "reportingInstance": instance, "firstTimestamp": stamp, "lastTimestamp": stamp, "count": 1}


class KubeEvents:
    """Posts Warning Events on the gateway's SamplerPool (its Role grants `events: create`)."""

    def __init__(self, pool: str, namespace: str, instance: str, throttle: Throttle | None = None) -> None:
        self.pool, self.namespace, self.instance = pool, namespace, instance
        self.throttle = throttle or Throttle()
        self._uid: str | None = None
        self._refused = False
        self._tasks: set[asyncio.Task[None]] = set()

    def warn(self, reason: str, message: str) -> None:
        log.warning("%s: %s", reason, message)
        if not self.throttle.due(reason, message):
            return
        task = asyncio.get_running_loop().create_task(asyncio.to_thread(self._post, reason, message))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _post(self, reason: str, message: str) -> None:
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        try:
            if self._uid is None:
                obj = client.CustomObjectsApi().get_namespaced_custom_object(
                    "sampler.rl.dev", "v1alpha1", self.namespace, "samplerpools", self.pool)
                self._uid = obj["metadata"]["uid"]
            client.CoreV1Api().create_namespaced_event(self.namespace, event_body(
                self.pool, self.namespace, self._uid, reason, message, self.instance, datetime.now(UTC)))
        except (ApiException, OSError, KeyError) as e:
            if not self._refused:
                self._refused = True
                log.warning("could not post the Event %s on SamplerPool %s: %s", reason, self.pool, e)
