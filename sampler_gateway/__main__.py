"""`python -m sampler_gateway --pool NAME --namespace NS ...`: run the pool's gateway (flags: `--help`)."""

from __future__ import annotations

import logging
import sys

import uvicorn

from sampler_common import rollout_trace

from .admin.pool_object import PoolObject
from .app import create_app
from .config import GatewayConfig, parse_config
from .discovery.peers import Directory
from .discovery.source import Source
from .discovery.static import StaticDiscovery
from .kube.events import EventSink
from .routing.switch import RoutingLease
from .server.listen import shared_listener


def source_for(cfg: GatewayConfig) -> Source:
    if cfg.discovery == "static":
        return StaticDiscovery(cfg.static_members(), cfg.replicas_file, cfg.adapters_file)
    from .discovery.kube import KubeDiscovery  # the kubernetes client only when it is used

    return KubeDiscovery(cfg.pool, cfg.namespace, peers=cfg.peer_url() is not None)


def holder_of(cfg: GatewayConfig) -> str:
    """This gateway's name among the pool's: its routing Lease's holder, unique per process when no pod
    name is given (two gateways sharing one Lease would each overwrite the other's acknowledgement)."""
    import os
    import socket

    return cfg.pod_name or f"{socket.gethostname()}-{os.getpid()}"[-200:]


def peers_for(cfg: GatewayConfig, source: Source) -> tuple[str, Directory] | None:
    """This gateway's name and its peers' directory (the pool's gateway Leases), when it shares its
    /health reads with them (discovery/peers.py)."""
    from .discovery.kube import KubeDiscovery

    if cfg.peer_url() is None or not isinstance(source, KubeDiscovery):
        return None
    return holder_of(cfg), source


def pool_object_for(cfg: GatewayConfig) -> PoolObject | None:
    """The SamplerPool the admin routes write: with kube discovery only (static has no pool object)."""
    if cfg.discovery == "static":
        return None
    from .admin.pool_object import KubePoolObject

    return KubePoolObject(cfg.pool, cfg.namespace)


def events_for(cfg: GatewayConfig) -> EventSink | None:
    """Events on the SamplerPool (a load a replica refused): with kube discovery only."""
    if cfg.discovery == "static":
        return None
    import os
    import socket

    from .kube.events import KubeEvents

    return KubeEvents(cfg.pool, cfg.namespace, cfg.pod_name or f"{socket.gethostname()}-{os.getpid()}")


def routing_lease_for(cfg: GatewayConfig, source: Source | None = None) -> RoutingLease | None:
    """The pool's routing switch: with kube discovery only (a static pool has no SamplerPool). Once its
    Lease renews after failing, `source`'s watches list again at once (KubeDiscovery.reconnect)."""
    if cfg.discovery == "static":
        return None
    from .discovery.kube import KubeDiscovery
    from .routing.switch import KubeRoutingLease

    holder = holder_of(cfg)
    reconnected = source.reconnect if isinstance(source, KubeDiscovery) else None
    return lambda switch, on_change, adapters: KubeRoutingLease(
        cfg.pool, cfg.namespace, holder, cfg.routing_lease_s, cfg.routing_renew_s, switch, on_change, adapters,
        reconnected, cfg.peer_url())


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(argv)
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    rollout_trace.enable_from_env()
    source = source_for(cfg)
    app = create_app(cfg, source, pool_object_for(cfg), routing_lease_for(cfg, source), events_for(cfg),
                     peers_for(cfg, source))
    # No proxy-headers middleware: the gateway reads no client address, and it ran on every request.
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level, access_log=False,
                            timeout_graceful_shutdown=10, timeout_keep_alive=75, proxy_headers=False)
    # A port shared with the other gateways on this host network (listen.py), else uvicorn's own bind.
    sockets = [shared_listener(cfg.host, cfg.port)] if cfg.reuse_port else None
    uvicorn.Server(config).run(sockets=sockets)
    return 0


if __name__ == "__main__":
    sys.exit(main())
