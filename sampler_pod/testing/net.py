"""Loopback helpers shared by tests, benchmarks and the local demo."""

from __future__ import annotations

import json
import socket
import threading
import urllib.error
import urllib.request
from typing import Any

# Every port this process handed out. The kernel's bind(0) can hand the same port out again as long
# as nobody has bound it yet, so two callers in one test could get one port: on the node tier a
# replica's port and the operator's health server's did, and the kubelet probed the operator.
_handed_out: set[int] = set()
_lock = threading.Lock()


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (every server here listens on loopback only), and
    never one this process handed out before."""
    return free_ports(1)


def free_ports(n: int) -> int:
    """The first of `n` consecutive ports free on 127.0.0.1, none of them handed out before (a
    hostNetwork pool's replicas listen on consecutive ports)."""
    with _lock:
        for _ in range(1000):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                first: int = s.getsockname()[1]
            ports = range(first, first + n)
            if first + n <= 65536 and _handed_out.isdisjoint(ports) and all(_bindable(p) for p in ports[1:]):
                _handed_out.update(ports)
                return first
    raise RuntimeError(f"no {n} consecutive free ports on 127.0.0.1")


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
