"""`create_app`: the gateway's FastAPI application, assembled in one place.

The gateway's services (pool, upstream client, metrics) live on `app.state.gateway`; the refresh
loop that keeps the pool's view current starts and stops with the app. Authentication (the same
API key as the replicas, forwarded to them as sent) is applied here once, to every router but
the probes, and handed to the generating routes, which check it themselves (plain Starlette routes:
routes/openai.py says why); the replicas check it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import AsyncIterator

from fastapi import Depends, FastAPI

from sampler_common.http.auth import APIKeyAuth
from sampler_common.http.errors import install_error_handlers
from sampler_common.http.middleware import ClientRequestMiddleware

from .admin.pool_object import PoolObject
from .admin.transfer import PoolTransfer
from .config import GatewayConfig
from .discovery.peers import Board, Directory, Sharing
from .discovery.refresh import Ledger, refresh_forever, refresh_once
from .discovery.source import Source
from .forwarding.forward import Gateway
from .kube.events import EventSink, NoEvents
from .metrics.added_latency import AddedLatency
from .metrics.registry import GatewayMetrics
from .routes import adapter_push, health, native, openai, tinker, twinkle, weight_transfer
from .routes import peers as peer_routes
from .routes import pool as pool_routes
from .routing.pool import Pool
from .routing.switch import RoutingLease, Switch
from .server.served_by import ServedBy
from .upstream.exchange import CONNECT_TIMEOUT_S, Upstream
from .upstream.http1 import Http1Client

ANY_METHOD = ["GET", "POST", "PUT", "PATCH", "DELETE"]
GC_YOUNG_OBJECTS = 10_000


def create_app(cfg: GatewayConfig, source: Source, pool_object: PoolObject | None = None,
               routing_lease: RoutingLease | None = None, events: EventSink | None = None,
               peers: tuple[str, Directory] | None = None) -> FastAPI:
    """`pool_object`: the SamplerPool the admin routes write (kube discovery); None: they answer 404.
    `routing_lease`: makes this gateway's routing Lease from the pool's switch and what to call when it
    moves (kube discovery, routing/switch.py); None: no switch. `events`: where Events on the pool go
    (kube/events.py; None: the log only). `peers`: this gateway's name and where the pool's other
    gateways are, to share the replicas' /health reads with them (discovery/peers.py); None: it reads
    every replica itself."""
    metrics = GatewayMetrics()
    board = Board(peers[0]) if peers is not None else None
    pool = Pool(cfg, metrics)
    lease = None
    if routing_lease is not None:
        pool.switch = Switch()
        lease = routing_lease(pool.switch, pool.switched, pool)
        pool.on_adapters = lease.wake

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # One HTTP client to the replicas, for requests and /health reads alike (http1.py: why its own).
        client = Http1Client(CONNECT_TIMEOUT_S)
        gateway = app.state.gateway = Gateway(cfg, pool, Upstream(client), metrics, events or NoEvents())
        # A push over the network (routes/weight_transfer.py): one at a time, through this gateway.
        app.state.transfer = PoolTransfer(gateway, pool_object)
        # One refresh before serving: a gateway that starts answers from a known replica set.
        with contextlib.suppress(Exception):
            await refresh_once(source, pool, client, min(cfg.health_timeout_s, cfg.refresh_interval_s))
        # The pool's routing before serving: a gateway started mid-switch enforces it from its first
        # answer (until a renewal succeeds it returns none: routing/switch.py).
        renewer = None
        if lease is not None:
            with contextlib.suppress(Exception):
                if await lease.renew():
                    await lease.renew()  # the acknowledgement of what it now enforces, before serving
            renewer = asyncio.create_task(lease.run_forever(), name="routing-lease")
        # What startup built lives as long as the process: frozen, the collector stops re-scanning it
        # on every full collection (as vLLM's API server does at startup).
        gc.collect()
        gc.freeze()
        # Most of what a request allocates dies with it. At the default young generation (700 objects)
        # the collector ran every few requests of a burst and re-scanned the bodies still in flight:
        # the gateway's CPU per request fell by 5-10% with a larger one (bench/burst_dispatch.py's burst).
        gc.set_threshold(GC_YOUNG_OBJECTS, *gc.get_threshold()[1:])
        sharing = app.state.sharing = None
        if peers is not None:
            key = cfg.api_key or cfg.admin_api_key
            sharing = app.state.sharing = Sharing(peers[0], peers[1], client, (("X-API-Key", key),) if key else (),
                                                  board)
        refresher = asyncio.create_task(
            refresh_forever(source, pool, client, cfg.refresh_interval_s, cfg.health_timeout_s,
                            cfg.health_failure_threshold, sharing, app.state.ledger), name="refresh")
        try:
            yield
        finally:
            for task in (refresher, renewer):
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
            await gateway.places.close()  # its watchers long-poll through the client closed next
            client.close()
            source.close()

    app = FastAPI(title="sampler-gateway", version="0.1.0", lifespan=lifespan)
    app.add_middleware(ClientRequestMiddleware, max_bytes=cfg.max_body_bytes)
    if cfg.pod_name:
        app.add_middleware(ServedBy, name=cfg.pod_name)
    # Added last, so outermost: its time covers the other middlewares and the route (added_latency.py).
    app.add_middleware(AddedLatency, histogram=metrics.added_latency)
    install_error_handlers(app)
    openai.install_error_shape(app)
    app.state.pool_object = pool_object
    app.state.board = board
    # Who read each replica last, and when (discovery/refresh.py): the refresh loop's, kept here to be looked at.
    app.state.ledger = Ledger()
    # The generating routes first: Starlette tries the routes in order, one regex each, on every request,
    # and a burst of samples crosses this list once per request (bench/burst_dispatch.py). No two of
    # these routers share a path, so the order decides nothing else.
    keys = APIKeyAuth(cfg.api_key, cfg.admin_api_key)
    app.router.routes.extend(openai.generating_routes(keys.sampling))
    auth = [Depends(keys.sampling)]
    for router in (openai.router, native.router, tinker.router, twinkle.router, weight_transfer.router,
                   peer_routes.router):
        app.include_router(router, dependencies=auth)
    app.include_router(health.router)
    admin = [Depends(pool_routes.PoolAdminAuth(cfg.api_key, cfg.admin_api_key))]
    for admin_router in (pool_routes.router, adapter_push.router, weight_transfer.admin_router):
        app.include_router(admin_router, dependencies=admin)
    # Last: whatever else is under /api/v1 goes to any replica unchanged.
    app.add_api_route("/api/v1/{path:path}", tinker.anywhere, methods=ANY_METHOD, dependencies=auth,
                      include_in_schema=False)
    return app
