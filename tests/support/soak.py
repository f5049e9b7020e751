"""The soak mix of issue #10: a seeded random mix of ordinary requests, deadlines that pass, clients
that disconnect, futures abandoned or cancelled, retrieves of expired ids and bad inputs, on the
native and Tinker protocols. The same mix runs in-process on the fake engine (tests/unit) and over
real HTTP on the real engine (tests/engine); `Client` is what differs.

Each kind says which statuses are right for it. A kind may also meet 429 (the limits are small on
purpose, so admission refuses under the burst); nothing may get a 5xx except a `timeout` kind's 504
(the request set a deadline it cannot meet: that is the documented answer).
"""

from __future__ import annotations

import asyncio
import collections
import json
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from tests.support import asgi

KINDS: dict[str, float] = {  # kind -> weight in the mix
    "sample": 20, "timeout": 8, "disconnect": 10, "future": 15, "abandoned_future": 10, "cancel": 8,
    "expired_retrieve": 5, "bad_input": 12, "unparseable": 4, "tinker_future": 5, "tinker_abandoned": 3,
}
ALLOWED: dict[str, set[int | None]] = {
    "sample": {200}, "timeout": {504}, "disconnect": {None, 200}, "future": {200},
    "abandoned_future": {200}, "cancel": {200, 410}, "expired_retrieve": {410},
    "bad_input": {400, 413}, "unparseable": {400}, "tinker_future": {200}, "tinker_abandoned": {200},
}
BAD_BODIES: list[dict[str, Any]] = [
    {"prompts": [[1, 2, 10**6]]}, {"prompts": [[1]], "sampling_params": {"seed": 2**70}},
    {"prompts": [[1]], "sampling_params": {"top_k": 2**40}}, {"prompts": []}, {"prompts": [[1]], "bogus": 1},
    {"prompts": [[1]], "num_samples": 10**9}, {"prompts": [[1]], "sampling_params": {"temperature": -1}},
    {"prompts": [[1]], "sampling_params": {"stop_token_ids": [2**63]}}, {"prompts": [[1]], "timeout_s": 10**9},
]
UNPARSEABLE: list[bytes] = [b'{"prompts": [[1, \xff]]}', b"[" * 5000, b'{"prompts": [[' + b"9" * 5000 + b"]]}"]


class Client(Protocol):
    async def post(self, path: str, body: Any, *, raw: bytes | None = None,
                   disconnect_after_s: float | None = None) -> tuple[int | None, Any]: ...


@dataclass
class SoakFigures:
    by_kind: collections.Counter[str] = field(default_factory=collections.Counter)
    statuses: dict[str, collections.Counter[int | None]] = field(
        default_factory=lambda: collections.defaultdict(collections.Counter))
    unexpected: list[str] = field(default_factory=list)

    def note(self, kind: str, status: int | None, detail: Any = None) -> None:
        self.statuses[kind][status] += 1
        if status not in ALLOWED[kind] and status != 429:
            self.unexpected.append(f"{kind}: {status} {str(detail)[:300]}")

    def table(self) -> str:
        rows = [f"  {k:18s} {self.by_kind[k]:6d}  " +
                ", ".join(f"{s}: {n}" for s, n in sorted(self.statuses[k].items(), key=lambda kv: str(kv[0])))
                for k in KINDS]
        return "\n".join(rows)


def _sample(rng: random.Random, max_tokens: int, **extra: Any) -> dict[str, Any]:
    prompt = [rng.randrange(1, 100) for _ in range(rng.randrange(1, 6))]
    return {"prompts": [prompt], "num_samples": rng.choice([1, 1, 2]),
            "sampling_params": {"max_tokens": max_tokens, "seed": rng.randrange(1000)}, **extra}


def _tinker(rng: random.Random, base_model: str, max_tokens: int) -> dict[str, Any]:
    return {"base_model": base_model, "num_samples": 1,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [rng.randrange(1, 100) for _ in range(3)]}]},
            "sampling_params": {"max_tokens": max_tokens, "seed": rng.randrange(1000)}}


@dataclass
class Soak:
    client: Client
    base_model: str
    rng: random.Random
    # Tokens per ordinary request, and for the ones meant to be cut short (a timeout, a disconnect).
    short_tokens: tuple[int, int] = (1, 4)
    long_tokens: int = 200
    disconnect_after_s: tuple[float, float] = (0.0, 0.02)
    figures: SoakFigures = field(default_factory=SoakFigures)
    # Futures are kept for this long once finished; an id abandoned 3 TTLs ago is surely swept.
    ttl_s: float = 1.0
    abandoned: list[tuple[str, float]] = field(default_factory=list)  # (future id never retrieved, when)

    def short(self) -> int:
        return self.rng.randint(*self.short_tokens)

    async def one(self, kind: str, i: int, retrieve_wait_s: float) -> None:
        c, rng, f = self.client, self.rng, self.figures
        f.by_kind[kind] += 1
        if kind == "sample":
            status, body = await c.post("/v1/sample", _sample(rng, self.short()))
        elif kind == "timeout":
            status, body = await c.post("/v1/sample", _sample(rng, self.long_tokens, timeout_s=0.005))
        elif kind == "disconnect":
            status, body = await c.post("/v1/sample", _sample(rng, self.long_tokens),
                                        disconnect_after_s=rng.uniform(*self.disconnect_after_s))
        elif kind in ("future", "abandoned_future", "cancel"):
            status, body = await c.post("/v1/sample/submit", _sample(rng, self.short()))
            if status == 200 and kind == "future":
                rid = body["request_id"]
                while True:  # 202: still running, ask again
                    status, body = await c.post("/v1/sample/retrieve", {"request_id": rid, "wait_s": retrieve_wait_s})
                    if status != 202:
                        break
            elif status == 200 and kind == "abandoned_future":
                self.abandoned.append((body["request_id"], time.monotonic()))
            elif status == 200 and kind == "cancel":
                rid = body["request_id"]
                if rng.random() < 0.5:
                    await asyncio.sleep(0)  # sometimes let it start first
                status, body = await c.post("/v1/sample/cancel", {"request_id": rid})
                if status == 200:
                    gone, _ = await c.post("/v1/sample/retrieve", {"request_id": rid, "wait_s": 0})
                    status = status if gone == 410 else gone
        elif kind == "expired_retrieve":
            if not self.abandoned or time.monotonic() - self.abandoned[0][1] < 3 * self.ttl_s:
                f.by_kind[kind] -= 1  # nothing has surely expired yet: an ordinary request instead
                return await self.one("sample", i, retrieve_wait_s)
            rid, _ = self.abandoned.pop(0)
            status, body = await c.post("/v1/sample/retrieve", {"request_id": rid, "wait_s": 0})
        elif kind == "bad_input":
            status, body = await c.post(rng.choice(["/v1/sample", "/v1/sample/submit"]), rng.choice(BAD_BODIES))
        elif kind == "unparseable":
            route = rng.choice(["/v1/sample", "/v1/sample/submit", "/api/v1/asample"])
            status, body = await c.post(route, None, raw=rng.choice(UNPARSEABLE))
        elif kind in ("tinker_future", "tinker_abandoned"):
            status, body = await c.post("/api/v1/asample", _tinker(rng, self.base_model, self.short()))
            if status == 200 and kind == "tinker_future":
                rid = body["request_id"]
                while True:  # try_again: still running, ask again
                    status, body = await c.post("/api/v1/retrieve_future", {"request_id": rid})
                    if not (status == 200 and isinstance(body, dict) and body.get("type") == "try_again"):
                        break
                if status == 200 and isinstance(body, dict) and "error" in body:
                    f.unexpected.append(f"{kind}: a failed request (Tinker's 200 with error): {body}")
            elif status == 200:
                self.abandoned.append((body["request_id"], time.monotonic()))
        else:
            raise AssertionError(kind)
        f.note(kind, status, body)

    async def run(self, n: int, concurrency: int, retrieve_wait_s: float = 5.0,
                  progress: Callable[[int], Awaitable[None]] | None = None) -> SoakFigures:
        kinds = self.rng.choices(list(KINDS), weights=list(KINDS.values()), k=n)
        it = iter(enumerate(kinds))

        async def worker() -> None:
            for i, kind in it:
                await self.one(kind, i, retrieve_wait_s)
                if progress is not None:
                    await progress(i)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return self.figures


def _decode(raw: bytes) -> Any:
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        return raw[:200]


@dataclass
class InprocClient:
    """The app called in-process through `tests.support.asgi` (fast; disconnects are exact)."""

    app: Any

    async def post(self, path: str, body: Any, *, raw: bytes | None = None,
                   disconnect_after_s: float | None = None) -> tuple[int | None, Any]:
        gone = None
        if disconnect_after_s is not None:
            gone = asyncio.Event()
            asyncio.get_running_loop().call_later(disconnect_after_s, gone.set)
        reply = await asgi.call(self.app, "POST", path, raw if raw is not None else body, disconnect=gone)
        return reply.status, _decode(reply.body)


@dataclass
class HttpClient:
    """A real HTTP client; a disconnect is a request cancelled mid-flight (httpx closes its connection)."""

    client: httpx.AsyncClient
    dropped: list[str] = field(default_factory=list)

    async def post(self, path: str, body: Any, *, raw: bytes | None = None,
                   disconnect_after_s: float | None = None) -> tuple[int | None, Any]:
        kw: dict[str, Any] = {"content": raw, "headers": {"content-type": "application/json"}} if raw is not None \
            else {"json": body}
        try:
            if disconnect_after_s is None:
                r = await self.client.post(path, **kw)
            else:
                try:
                    r = await asyncio.wait_for(self.client.post(path, **kw), disconnect_after_s)
                except TimeoutError:
                    return None, None
        except httpx.TransportError as e:
            self.dropped.append(f"{path}: {type(e).__name__}: {e}")
            return -1, None
        return r.status_code, _decode(r.content)
