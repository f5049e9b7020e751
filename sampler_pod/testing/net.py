"""Loopback helpers shared by tests, benchmarks and the local demo."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from typing import Any


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (every server here listens on loopback only)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def post_json(url: str, body: dict[str, Any], timeout: float = 120,
              api_key: str | None = None) -> tuple[int, dict[str, Any]]:
    """POST a JSON body (with `X-API-Key` when given); (status, JSON answer) whether a success or an error."""
    headers = {"Content-Type": "application/json", **({"X-API-Key": api_key} if api_key else {})}
    req = urllib.request.Request(url, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            out: dict[str, Any] = json.loads(r.read())
            return r.status, out
    except urllib.error.HTTPError as e:
        err: dict[str, Any] = json.loads(e.read() or b"{}")
        return e.code, err
