"""`X-Sampler-Gateway: <pod>` on every answer: which of the pool's gateways answered.

Behind the pool's Service (or a port shared on a node, listen.py) a client does not choose its
gateway; with several, the one that answered is what an operator needs to read the right logs and
metrics, and what a test needs to know that every gateway served. The replica is already named
(`X-Sampler-Replica`); this names the hop before it. A pure ASGI middleware: it only adds a header.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

GATEWAY_HEADER = "X-Sampler-Gateway"


class ServedBy:
    def __init__(self, app: ASGIApp, name: str) -> None:
        self.app = app
        self.header = (GATEWAY_HEADER.lower().encode(), name.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def named(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, named)
