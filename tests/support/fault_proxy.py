"""An HTTP/1.1 proxy on 127.0.0.1 in front of one replica, failing the exchanges a test names (issue #54).

The gateway is given the proxy's address for the replica. Every exchange is one connection (the proxy
asks the replica for `Connection: close`, and the replica's answer says so to the gateway, which then
reuses nothing), so the proxy can fail exactly one kind of exchange, each in the ways a replica
fails in a cluster:

- `down()`: the replica is gone: the listener is closed and every connection cut, so each new
  exchange is refused (the gateway's `NotStarted`); `up()` listens again on the same port.
- `arm(step, action)`: the next exchanges of one step of a placement fail, by `action`:
  - `break`: the connection is cut as the request arrives (`Lost`); the replica stays up;
  - `die`: as `break`, and the replica is gone from then on (`down`);
  - `stall`: never answered, until `up()`/`disarm()` (`TimedOut` at the gateway's bound);
  - `answer_then_die`: the replica does it, but its answer never arrives, and the replica is gone;
  - `answer_then_refuse`: answered, then the replica is gone: the NEXT exchange is refused.
  A rule fires once unless `every=True`.

Steps, by the request's method and path: `health` (GET /health), `unload` (DELETE /v1/adapters/...),
`load` (POST /v1/adapters), `sample` (POST /v1/sample, /v1/completions, /v1/chat/completions).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Literal

from sampler_pod.testing.net import free_port

Step = Literal["health", "unload", "load", "sample"]
Action = Literal["break", "die", "stall", "answer_then_die", "answer_then_refuse"]
SAMPLE_PATHS = ("/v1/sample", "/v1/completions", "/v1/chat/completions")


def step_of(method: str, path: str) -> Step | None:
    path = path.partition("?")[0]
    if method == "GET" and path == "/health":
        return "health"
    if method == "DELETE" and path.startswith("/v1/adapters/"):
        return "unload"
    if method == "POST" and path == "/v1/adapters":
        return "load"
    if method == "POST" and path in SAMPLE_PATHS:
        return "sample"
    return None


@dataclass
class _Rule:
    step: Step
    action: Action
    every: bool


class FaultProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.fired: list[tuple[Step, Action]] = []  # what the rules did, in order
        self._rules: list[_Rule] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fault-proxy", daemon=True)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._stalls: list[asyncio.Future[None]] = []
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ the test's side

    def start(self) -> FaultProxy:
        self._thread.start()
        self.up()
        return self

    def up(self) -> None:
        """Listening again on the same port; stalls and rules cleared."""
        self._call(self._up())

    def down(self) -> None:
        self._call(self._down())

    def arm(self, step: Step, action: Action, *, every: bool = False) -> None:
        with self._lock:
            self._rules.append(_Rule(step, action, every))

    def arm_all(self, *rules: tuple[Step, Action]) -> None:
        """Several rules at once; the second and later fire every time (the replica stays broken)."""
        for i, (step, action) in enumerate(rules):
            self.arm(step, action, every=i > 0)

    def disarm(self) -> None:
        with self._lock:
            self._rules.clear()
        self._call(self._release_stalls())

    def close(self) -> None:
        self._call(self._down())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _call(self, coro: object) -> None:
        fut: Future[None] = asyncio.run_coroutine_threadsafe(coro, self._loop)  # type: ignore[arg-type]
        fut.result(10)

    # ------------------------------------------------------------------ the proxy's loop

    async def _up(self) -> None:
        with self._lock:
            self._rules.clear()
        await self._release_stalls()
        if self._server is None:
            self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port, reuse_address=True)

    async def _down(self) -> None:
        self._stop_listening()
        for w in list(self._writers):
            w.transport.abort()
        self._writers.clear()
        await self._release_stalls()

    def _stop_listening(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    async def _release_stalls(self) -> None:
        for f in self._stalls:
            if not f.done():
                f.set_result(None)
        self._stalls.clear()

    def _rule_for(self, step: Step | None) -> Action | None:
        with self._lock:
            for rule in self._rules:
                if rule.step == step:
                    if not rule.every:
                        self._rules.remove(rule)
                    self.fired.append((rule.step, rule.action))
                    return rule.action
        return None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            request_line, *lines = head.decode("latin-1").split("\r\n")
            method, path, _ = request_line.split(" ", 2)
            headers = [line.split(":", 1) for line in lines if ":" in line]
            length = next((int(v) for k, v in headers if k.strip().lower() == "content-length"), 0)
            body = await reader.readexactly(length) if length else b""
            action = self._rule_for(step_of(method, path))
            if action in ("break", "die"):
                writer.transport.abort()
                if action == "die":
                    await self._down()
                return
            if action == "stall":
                stall = asyncio.get_running_loop().create_future()
                self._stalls.append(stall)
                await stall
                writer.transport.abort()
                return
            kept = "".join(f"{k}:{v}\r\n" for k, v in headers if k.strip().lower() != "connection")
            answer = await self._forward(f"{request_line}\r\n{kept}Connection: close\r\n\r\n".encode("latin-1") + body,
                                         writer if action is None else None)
            if action == "answer_then_die":
                writer.transport.abort()
                await self._down()
            elif action == "answer_then_refuse":
                # No connection accepted once the answer is out (a connection made meanwhile would sit
                # in the closed listener's queue, unanswered, not refused); and the whole answer out
                # before the replica goes (`_down` aborts the connections it finds, and an abort drops
                # what is not sent yet).
                self._stop_listening()
                self._writers.discard(writer)
                writer.write(answer)
                with contextlib.suppress(ConnectionError):
                    writer.close()
                    await writer.wait_closed()
                await self._down()
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass
        finally:
            self._writers.discard(writer)
            with contextlib.suppress(Exception):
                writer.close()

    async def _forward(self, request: bytes, relay: asyncio.StreamWriter | None) -> bytes:
        """Send the request to the replica; its answer relayed as it comes (a stream's events too), or,
        with `relay` None, kept and returned whole."""
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        kept = bytearray()
        try:
            up_writer.write(request)
            await up_writer.drain()
            while chunk := await up_reader.read(1 << 16):
                if relay is None:
                    kept += chunk
                else:
                    relay.write(chunk)
                    await relay.drain()
        finally:
            up_writer.close()
        return bytes(kept)


@contextlib.contextmanager
def fault_proxy(target_url: str) -> Iterator[FaultProxy]:
    host, _, port = target_url.removeprefix("http://").rstrip("/").partition(":")
    proxy = FaultProxy(host, int(port)).start()
    try:
        yield proxy
    finally:
        proxy.close()
