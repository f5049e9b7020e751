"""A LoRA push waits for every live gateway of the pool to route by it: `Latest` per run across gateways.

A push lands in `spec.adapters` and reaches each gateway by its own watch, moments apart. Without a
wait, a trainer whose push returned could still have `<run>` resolved to the older step by a gateway
one watch event behind. So each gateway says in its routing Lease which declared adapters it routes
by (`spec.adapters.serial`, sampler_common/gateway_leases.py; written by routing/switch.py at once when they
move on), and the push answers only once every live gateway's Lease says the pushed version's serial
or later. A gateway routing by a newer declared state also stops returning `<run>` answers of an
older step (lora.names.RunOrder), so from the push's answer on, no gateway returns an older step
of the run either.

The wait is bounded: a gateway whose Lease is not renewed within its duration (+ the clock skew
allowance) is not waited for, because it then returns nothing (routing/switch.py's self-fence), and a
gateway that renews reads the pool at each renewal and routes by what it read before it serves on
(Pool.learn_declared), so a live gateway says the new serial at most one renewal after the write.
Past the bound the push answers 503 `gateways` naming those still behind (a repeat of the push is
answered once they catch up).

Waiting is a watch of the pool's gateway Leases (RBAC: list and watch of Leases in the namespace),
not a poll: the last acknowledgement ends the wait one API event after it is written.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from typing import Any

from sampler_common.gateway_leases import CLOCK_SKEW_S, GATEWAY_LABEL, GatewayAck, adapters_waiting_for

from ..kube.client import load_kube_config

# A list or watch call never takes longer than this (the API server away: the bound still holds).
CALL_TIMEOUT_S = 5.0


class KubeAdapterAcks:
    """The pool's gateway Leases, read to wait for their adapters acknowledgement."""

    def __init__(self, pool_label: str, namespace: str) -> None:
        from kubernetes import client

        load_kube_config()
        self.namespace, self.selector = namespace, f"{GATEWAY_LABEL}={pool_label}"
        self._api = client.CoordinationV1Api()

    async def behind(self, serial: int, timeout_s: float) -> list[str]:
        """Wait until every live gateway of the pool routes by declared adapters up to `serial`, at
        most `timeout_s`; the names of those still behind then ([]: none)."""
        return await asyncio.to_thread(self._behind, serial, timeout_s)

    def _list(self) -> tuple[dict[str, GatewayAck], str]:
        resp = self._api.list_namespaced_lease(self.namespace, label_selector=self.selector,
                                               _preload_content=False, _request_timeout=CALL_TIMEOUT_S)
        body = json.loads(resp.data)
        acks = {str((o.get("metadata") or {}).get("name")): GatewayAck.from_lease(o) for o in body.get("items") or []}
        return acks, str((body.get("metadata") or {}).get("resourceVersion") or "")

    def _behind(self, serial: int, timeout_s: float) -> list[str]:
        from kubernetes import watch

        deadline = time.monotonic() + timeout_s
        behind: list[str] = []
        while True:
            try:
                acks, version = self._list()
            except Exception:  # the API server away: wait out the bound, then say who is unknown
                acks, version = {}, ""
                behind = behind or ["(the gateways' Leases could not be read)"]
            else:
                behind = adapters_waiting_for(acks.values(), serial, time.time())
                if not behind:
                    return []
            left = deadline - time.monotonic()
            if left <= 0:
                return behind
            # A Lease expiring changes the answer with no event: watch until the first such moment.
            now = time.time()
            expiries = [a.renewed + a.duration_s + CLOCK_SKEW_S - now for a in acks.values()
                        if a.name in behind and a.renewed is not None]
            wait = max(0.05, min([left, CALL_TIMEOUT_S, *(e + 0.05 for e in expiries)]))
            if not version:
                time.sleep(min(wait, 0.5))  # no list to watch from: the API server is away
                continue
            w = watch.Watch()
            try:
                for ev in w.stream(self._api.list_namespaced_lease, self.namespace, label_selector=self.selector,
                                   resource_version=version, timeout_seconds=max(1, math.ceil(wait)),
                                   _request_timeout=wait + 1):
                    obj: Any = ev.get("raw_object")
                    if not isinstance(obj, dict):
                        continue
                    name = str((obj.get("metadata") or {}).get("name"))
                    if ev.get("type") == "DELETED":
                        acks.pop(name, None)
                    else:
                        acks[name] = GatewayAck.from_lease(obj)
                    if not adapters_waiting_for(acks.values(), serial, time.time()):
                        return []
                    if time.monotonic() >= deadline:
                        break
            except Exception:  # an ended or failed watch: list again
                pass
            finally:
                w.stop()
