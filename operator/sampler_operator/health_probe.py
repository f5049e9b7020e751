"""Look at one sampler pod: GET http://{podIP}:{port}/health with a timeout.

`classify` is pure (status code + body -> observation), so the decision table in
replacement_policy.py is tested without sockets; `probe` is the thin network part.
"""
from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp


class HealthState(enum.StrEnum):
    OK = "ok"
    STARTING = "starting"
    UNCERTAIN_WEIGHTS = "uncertain_weights"
    ENGINE_DEAD = "engine_dead"
    ENGINE_STALLED = "engine_stalled"  # alive, its engine making no progress: the kubelet restarts it
    UNREACHABLE = "unreachable"      # refused, reset, timed out: no answer at all
    BAD_RESPONSE = "bad_response"    # answered, but not with the contract's JSON


@dataclass(frozen=True)
class HealthObservation:
    state: HealthState
    http_status: int | None = None
    reason: str | None = None
    weights_version: int | None = None
    weights_label: str | None = None
    in_flight: int | None = None
    # Declared-weights contract (docs/reference/contract.md): where the current weights came from, the
    # newest validated load (what a replacement must load), and the checkpoint whose write failed.
    weights_checkpoint: str | None = None
    # The model digest of the serving weights, when they were pushed over the network (or checked against one).
    weights_sha256: str | None = None
    weights_loaded_at: str | None = None
    intended: Mapping[str, Any] | None = None
    failed_write: Mapping[str, Any] | None = None
    adapters: tuple[Mapping[str, Any], ...] = ()
    # With engine_stalled: {"since_progress_s": seconds since the engine's last token, "waiting": requests}.
    stall: Mapping[str, Any] | None = None
    # What the pod's logprobs are (vLLM's --logprobs-mode); None from a pod that does not say.
    logprobs_mode: str | None = None

    @property
    def answered(self) -> bool:
        return self.state not in (HealthState.UNREACHABLE, HealthState.BAD_RESPONSE)


def classify(http_status: int, body: bytes | str) -> HealthObservation:
    """Map a /health answer to an observation; anything off-contract is BAD_RESPONSE."""
    try:
        doc: Any = json.loads(body)
        state = HealthState(doc["status"])
    except (ValueError, KeyError, TypeError):
        return HealthObservation(HealthState.BAD_RESPONSE, http_status, reason=f"HTTP {http_status}, not contract JSON")
    if state in (HealthState.UNREACHABLE, HealthState.BAD_RESPONSE):  # not values a pod may report
        return HealthObservation(HealthState.BAD_RESPONSE, http_status, reason=f"unknown status {doc['status']!r}")
    version = doc.get("weights_version")
    return HealthObservation(
        state=state,
        http_status=http_status,
        reason=doc.get("reason"),
        weights_version=version if isinstance(version, int) else None,
        weights_label=doc.get("weights_label"),
        in_flight=doc.get("in_flight"),
        weights_checkpoint=_str_or_none(doc.get("weights_checkpoint")),
        weights_sha256=_str_or_none(doc.get("weights_sha256")),
        weights_loaded_at=_str_or_none(doc.get("weights_loaded_at")),
        intended=doc.get("intended") if isinstance(doc.get("intended"), dict) else None,
        failed_write=doc.get("failed_write") if isinstance(doc.get("failed_write"), dict) else None,
        adapters=tuple(a for a in doc.get("adapters") or [] if isinstance(a, dict)),
        stall=doc.get("stall") if isinstance(doc.get("stall"), dict) else None,
        logprobs_mode=_str_or_none(doc.get("logprobs_mode")),
    )


def _str_or_none(v: Any) -> str | None:
    return v if isinstance(v, str) else None


def health_url(pod_ip: str, port: int) -> str:
    host = f"[{pod_ip}]" if ":" in pod_ip else pod_ip
    return f"http://{host}:{port}/health"


async def probe(session: aiohttp.ClientSession, pod_ip: str, port: int, timeout_s: float) -> HealthObservation:
    """One probe. Never raises for network trouble: unreachable is an observation, not an error."""
    try:
        async with session.get(health_url(pod_ip, port), timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            body = await resp.read()
            return classify(resp.status, body)
    except (TimeoutError, aiohttp.ClientError, OSError) as e:
        return HealthObservation(HealthState.UNREACHABLE, reason=f"{type(e).__name__}: {e}"[:200])
