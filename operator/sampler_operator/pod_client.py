"""The operator's calls to a sampler pod's weight routes (docs/guide/sampler.md), with the replica's admin key.

`outcome_of` is pure (status code + body -> outcome), so what the operator does with each answer
is tested without sockets; the rest is the thin network part. Network trouble is an outcome
(`transient`), never an exception: the replica loop simply tries again later.
"""
from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

import aiohttp

from sampler_operator.health_probe import health_url


class Outcome(enum.StrEnum):
    DONE = "done"              # the pod did it
    INVALID = "invalid"        # the pod refused the request itself (validation): retrying cannot help
    WRITE_FAILED = "write_failed"  # the write failed midway: the pod is uncertain now
    TRANSIENT = "transient"    # busy, starting, timed out, unreachable, unauthorized: try again later


@dataclass(frozen=True)
class PodAnswer:
    outcome: Outcome
    message: str
    http_status: int | None = None
    # A 2xx answer's JSON object (a load's names what the pod serves now); None otherwise.
    body: dict[str, Any] | None = None
    # An error answer's category (`weights_unavailable`: a load by digest found the weights nowhere).
    category: str | None = None


def outcome_of(http_status: int, body: bytes) -> PodAnswer:
    try:
        doc: Any = json.loads(body)
    except ValueError:
        doc = None
    err = doc.get("error") if isinstance(doc, dict) and http_status >= 400 else None
    message = str(err.get("message")) if isinstance(err, dict) else body[:500].decode(errors="replace")
    if 200 <= http_status < 300:
        return PodAnswer(Outcome.DONE, "ok", http_status, doc if isinstance(doc, dict) else None)
    if http_status == 500 and isinstance(err, dict) and err.get("category") == "weight_write_failed":
        return PodAnswer(Outcome.WRITE_FAILED, message, http_status)
    # 401 (a key not yet mounted), 403 (a key that may not load: a misconfigured admin Secret),
    # 409 (adapter busy), 429, 5xx, 504 (drain timed out): later.
    category = str(err.get("category")) if isinstance(err, dict) and err.get("category") else None
    if http_status in (400, 404, 413, 422):
        return PodAnswer(Outcome.INVALID, message, http_status, category=category)
    return PodAnswer(Outcome.TRANSIENT, f"HTTP {http_status}: {message}", http_status, category=category)


def _base(pod_ip: str, port: int) -> str:
    return health_url(pod_ip, port).removesuffix("/health")


async def call(session: aiohttp.ClientSession, method: str, pod_ip: str, port: int, path: str,
               api_key: str | None, body: dict[str, Any] | None, timeout_s: float) -> PodAnswer:
    headers = {"X-API-Key": api_key} if api_key else {}
    try:
        async with session.request(method, _base(pod_ip, port) + path, json=body, headers=headers,
                                   timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            return outcome_of(resp.status, await resp.read())
    except (TimeoutError, aiohttp.ClientError, OSError) as e:
        return PodAnswer(Outcome.TRANSIENT, f"{type(e).__name__}: {e}"[:300])
