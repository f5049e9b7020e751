"""The request head of a hand-made HTTP/1.1 server on an asyncio stream: the stubs that stand in for a
replica (openai_stub.py, bench/burst_dispatch.py) answer a handful of paths and need no framework, and
they must see exactly what the gateway sent (its method, path and headers)."""

from __future__ import annotations

import asyncio


async def read_head(reader: asyncio.StreamReader) -> tuple[str, str, dict[str, str]]:
    """(method, path, headers with lower-case names) of the next request on `reader`. Raises
    asyncio.IncompleteReadError when the client closed the connection between requests."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    return method, path, headers
