"""Several gateways on one host network (issue #24, a pool's gateway Deployment with replicas > 1
on the node's network): each listens with SO_REUSEPORT on the same port (listen.py), and each
answer names the gateway that gave it (served_by.py)."""

from __future__ import annotations

import socket

import pytest

from sampler_gateway.app import create_app
from sampler_gateway.config import GatewayConfig, parse_config
from sampler_gateway.discovery.static import StaticDiscovery
from sampler_gateway.server.listen import shared_listener
from sampler_pod.testing.net import free_port
from tests.support.asgi import call


def test_two_gateways_listen_on_one_port_and_both_are_reached() -> None:
    port = free_port()
    a, b = shared_listener("127.0.0.1", port), shared_listener("127.0.0.1", port)
    try:
        for s in (a, b):
            s.listen(64)
            s.settimeout(0)
        # A listener without the option cannot join them: the option is what makes the port shared.
        plain = socket.socket()
        with pytest.raises(OSError):
            plain.bind(("127.0.0.1", port))
        plain.close()
        # New connections are spread over both (by the kernel's hash of each connection's address):
        # of 64, each listener gets some.
        clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(64)]
        accepted = {"a": 0, "b": 0}
        for name, s in (("a", a), ("b", b)):
            while True:
                try:
                    conn, _ = s.accept()
                except BlockingIOError:
                    break
                conn.close()
                accepted[name] += 1
        for c in clients:
            c.close()
        assert sum(accepted.values()) == 64 and min(accepted.values()) > 0, accepted
    finally:
        a.close()
        b.close()


def test_reuse_port_is_a_flag_off_by_default() -> None:
    base = ["--pool", "p", "--discovery", "static", "--replica", "r0=http://127.0.0.1:1"]
    assert parse_config(base, environ={}).reuse_port is False
    assert parse_config([*base, "--reuse-port"], environ={}).reuse_port is True


@pytest.mark.parametrize("pod_name", ["p-gateway-7d9c-x2", None])
async def test_every_answer_names_its_gateway_pod(pod_name: str | None) -> None:
    cfg = GatewayConfig(pool="p", discovery="static", replicas=["r0=http://127.0.0.1:9"], api_key="tml-k",
                        pod_name=pod_name)
    app = create_app(cfg, StaticDiscovery(cfg.static_members(), None))
    # An answer the gateway gives itself (no key: 401) is named too, not only forwarded ones.
    r = await call(app, "POST", "/v1/sample", {"prompts": [[1]]})
    assert r.status == 401
    assert r.headers.get("x-sampler-gateway") == pod_name
