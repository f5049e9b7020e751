"""`python -m sampler_pod --model DIR ...`: start the sampler server (flags: `--help`)."""

from __future__ import annotations

import logging
import sys

import uvicorn

from sampler_common import heap, rollout_trace

from .config import parse_config
from .core.sampler import SamplerCore
from .core.startup import engine_starter, with_startup_deadline
from .http.app import create_app
from .weights.service import WeightsService
from .weights.startup import with_initial_weights


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(argv)
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    rollout_trace.enable_from_env()
    server: uvicorn.Server | None = None

    def on_fatal() -> None:
        if server is not None:
            server.should_exit = True

    if cfg.weight_transfer_backend is not None:
        heap.keep_stream_buffers()  # a catch-up from a peer streams the model through this process
    core = SamplerCore(cfg)
    weights = WeightsService(core)
    # The engine first, then the weights the replica must serve, and only then ready.
    start = with_startup_deadline(cfg, with_initial_weights(cfg, weights, engine_starter(cfg, on_fatal), on_fatal),
                                  on_fatal)
    app = create_app(cfg, start, core=core, weights_service=weights)
    server = uvicorn.Server(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level,
                                           access_log=False, timeout_graceful_shutdown=10,
                                           # Longer than clients' pools (httpx: 5 s), so the server is
                                           # never the side closing a connection a client is reusing.
                                           timeout_keep_alive=75))
    server.run()
    return 1 if core.startup_error else 0


if __name__ == "__main__":
    sys.exit(main())
