"""`python -m sampler_pod --model DIR ...`: start the sampler server."""

from __future__ import annotations

import asyncio
import logging
import sys

import uvicorn

from .app import create_app
from .config import ServerConfig, parse_config
from .core import SamplerCore

log = logging.getLogger("sampler_pod")


def engine_starter(cfg: ServerConfig, on_fatal: "callable[[], None]"):  # type: ignore[valid-type]
    async def start(core: SamplerCore) -> None:
        from .startup_lock import resolve_model, start_under_lock

        try:
            # Resolve (and download) the model before the lock: a slow download
            # must not hold up a sibling engine's startup in the same pod.
            model_dir = await asyncio.to_thread(resolve_model, cfg.model)
            core.set_model_dir(model_dir)
            if cfg.engine == "fake":
                from .fake_engine import FakeEngine

                core.engine = FakeEngine.for_model(model_dir)
            else:
                from .engine import VllmEngine

                core.engine = await start_under_lock(
                    cfg.startup_lock_path, cfg.startup_lock_timeout_s,
                    lambda: asyncio.to_thread(VllmEngine.create, model_dir, cfg))
            log.info("engine ready: model=%s", model_dir)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            core.startup_error = f"engine startup failed: {type(e).__name__}: {e}"
            log.error("%s", core.startup_error)
            on_fatal()

    return start


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(argv)
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server: uvicorn.Server | None = None

    def on_fatal() -> None:
        if server is not None:
            server.should_exit = True

    app = create_app(cfg, engine_starter(cfg, on_fatal))
    server = uvicorn.Server(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level,
                                           access_log=False, timeout_graceful_shutdown=10,
                                           # Longer than clients' pools (httpx: 5 s), so the server is
                                           # never the side closing a connection a client is reusing.
                                           timeout_keep_alive=75))
    server.run()
    core: SamplerCore = app.state.core
    return 1 if core.startup_error else 0


if __name__ == "__main__":
    sys.exit(main())
