"""What every HTTP request goes through before (and while) a route runs: the body limit and
client-disconnect detection. Both need to own the ASGI `receive` channel, so they are one middleware.

- **Body limit.** The body is read here, at most `max_bytes` of it, and replayed to the app. Past
  the limit the answer is 413 naming `body`, whether the client declared a Content-Length or sent
  the body chunked (checked as it arrives, so an over-limit body is never held in memory whole).
  Raising inside the app's `receive` instead would not work: FastAPI turns any error while it
  reads the body into a 400.
- **Disconnect.** Once the body is in, the connection is watched. A client that goes away before
  its response is complete gets its route cancelled: a synchronous sample then aborts its engine
  calls, and its slot is freed when the engine lets go (`sampler_pod`'s `SamplerCore.sample`); in the
  gateway the cancelled forward closes its connection, so the replica sees the disconnect. Routes
  that must not stop halfway (weight writes) run their work in a shielded task, so cancelling the
  route never cancels that work.
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..errors import BodyTooLarge
from .errors import error_response


class ClientRequestMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_big(self) -> BodyTooLarge:
        return BodyTooLarge(f"request body is over {self.max_bytes} bytes", field="body")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for k, v in scope.get("headers", []):
            if k == b"content-length" and v.isdigit() and int(v) > self.max_bytes:
                await error_response(self._too_big())(scope, receive, send)
                return
        chunks: list[bytes] = []
        seen = 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return  # gone before the body was in: there is nothing to answer
            chunk = msg.get("body", b"")
            seen += len(chunk)
            if seen > self.max_bytes:
                await error_response(self._too_big())(scope, receive, send)
                return
            chunks.append(chunk)
            if not msg.get("more_body", False):
                break
        await self._run_watched(scope, b"".join(chunks), receive, send)

    async def _run_watched(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        # The route runs in this task, and a watcher task cancels it if the client goes away: one
        # task more per request, not two (a task for the route and a wait on both showed in the
        # gateway's profile, where every request crosses this middleware twice).
        route = asyncio.current_task()
        assert route is not None
        gone = asyncio.Event()
        replayed = False
        response_complete = False
        stopped_by_watcher = False

        async def app_receive() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def app_send(msg: Message) -> None:
            nonlocal response_complete
            if msg["type"] == "http.response.body" and not msg.get("more_body", False):
                response_complete = True
            await send(msg)

        async def watch() -> None:
            nonlocal stopped_by_watcher
            # With the body read, the server's receive returns only `http.disconnect`: when the client
            # goes away, or (uvicorn) once the response is complete.
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()
            if not response_complete:
                # The client is gone: stop the route (a sync sample aborts its engine calls).
                stopped_by_watcher = True
                route.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            await self.app(scope, app_receive, app_send)
        except asyncio.CancelledError:
            # Ours (the client went away): the route has stopped and there is nobody to answer. Any
            # other cancellation (the server shutting down) goes on up.
            if stopped_by_watcher and route.uncancel() == 0:
                return
            raise
        else:
            if stopped_by_watcher:
                route.uncancel()  # the route swallowed our cancellation: none is left pending on this task
        finally:
            watcher.cancel()
