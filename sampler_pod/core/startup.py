"""Engine startup: resolve the model, then build the engine under the pod-local startup lock.

The model is resolved (and downloaded, for a hub id) BEFORE the lock: a slow download must
not hold up a sibling engine's startup in the same pod. A failure is recorded on the core
(`/health` reports `engine_dead` with the reason) and `on_fatal` stops the server, so the
kubelet restarts the container.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from .. import STARTED_AT
from ..config import ServerConfig
from ..engine.startup_lock import resolve_model, start_under_lock
from .sampler import SamplerCore

log = logging.getLogger(__name__)

# What `create_app` runs in the background at startup: it sets `core.engine` (or records the error).
EngineStarter = Callable[[SamplerCore], Coroutine[Any, Any, None]]


def engine_starter(cfg: ServerConfig, on_fatal: Callable[[], None]) -> EngineStarter:
    async def start(core: SamplerCore) -> None:
        if cfg.test_hang_startup:
            # TEST SEAM (parse_config refuses it without --enable-test-seams): a hung engine start,
            # so the operator's startup deadline can be tested. `/health` stays `starting`.
            log.warning("TEST SEAM --test-hang-startup: the engine will never start")
            await asyncio.Event().wait()
        try:
            model_dir = await asyncio.to_thread(resolve_model, cfg.model)
            core.set_model_dir(model_dir)
            if cfg.engine == "fake":
                from ..engine.fake import FakeEngine, FakeWeightReceiver

                fake = FakeEngine.for_model(model_dir)
                if cfg.weight_transfer_backend is not None:
                    fake.receiver = FakeWeightReceiver(fake, backend=cfg.weight_transfer_backend)
                core.engine = fake
            else:
                from ..engine.vllm import VllmEngine

                engine = await start_under_lock(
                    cfg.startup_lock_path, cfg.startup_lock_timeout_s,
                    lambda: asyncio.to_thread(VllmEngine.create, model_dir, cfg))
                try:
                    if cfg.weight_transfer_backend is not None:
                        await engine.keep_stream_buffers()  # the worker's side of a catch-up (sampler_common/heap.py)
                    await engine.require_seeded_chunks()
                    if cfg.enable_lora:
                        await engine.require_lora_isolation()
                    await core.warm_up(engine)
                except Exception:
                    await engine.shutdown()
                    raise
                core.engine = engine
            log.info("engine ready: model=%s", model_dir)
            # What startup built (torch, vLLM, the engine client) lives as long as the process: frozen,
            # full collections stop re-scanning it while requests run (vLLM's API server does the same).
            gc.collect()
            gc.freeze()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            core.startup_error = f"engine startup failed: {type(e).__name__}: {e}"
            log.error("%s", core.startup_error)
            on_fatal()

    return start


def with_startup_deadline(cfg: ServerConfig, start: EngineStarter, on_fatal: Callable[[], None]) -> EngineStarter:
    """`start`, bounded by `--startup-timeout-s`: a start that has not finished by then (a hung engine,
    a stuck weights load) is a startup error and the server exits 1, so the kubelet restarts the
    container at once. (A failing startup probe alone is not enough everywhere: kubelets before
    1.21 act on it only at their next pod sync, up to a minute later.)"""
    if cfg.startup_timeout_s is None:
        return start
    deadline_s = cfg.startup_timeout_s

    async def bounded(core: SamplerCore) -> None:
        task = asyncio.ensure_future(start(core))
        try:
            done, _ = await asyncio.wait({task}, timeout=max(0.0, STARTED_AT + deadline_s - time.monotonic()))
        except asyncio.CancelledError:
            task.cancel()
            raise
        if not done:
            task.cancel()
            core.startup_error = f"startup did not finish within --startup-timeout-s={deadline_s:g}s"
            # The process's age says how late the loop answered the deadline: on a starved node the
            # imports alone can outlast it, and then the deadline is acted on as soon as the loop runs.
            log.error("%s (process age %.2fs); exiting so the container is restarted",
                      core.startup_error, time.monotonic() - STARTED_AT)
            on_fatal()

    return bounded
