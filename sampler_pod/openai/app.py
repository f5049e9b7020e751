"""vLLM's OpenAI-compatible routes, as vLLM serves them, inside the replica's server.

`build_openai_app` assembles a FastAPI app the way vLLM's `build_app` does, from vLLM's own
routers and exception handlers, limited to the routes an RL rollout uses (`PATHS`), behind
`OpenAIGuard`. `create_app` (http/app.py) routes exactly these paths to it; every other path stays
the replica's own. Once the engine is up, `OpenAIRoutes.start` fills vLLM's serving state with
vLLM's own `init_app_state`, over `GuardedEngineClient`, from the flags vLLM's server would take
(`vllm_args`).
"""

from __future__ import annotations

import logging
from argparse import Namespace
from dataclasses import dataclass
from typing import Any

from sampler_common.http.auth import APIKeyAuth

from ..config import ServerConfig
from ..core.sampler import SamplerCore
from ..engine.vllm import VllmEngine
from .engine_client import GuardedEngineClient, LoadedAdapters
from .guard import OpenAIGuard
from .paths import OPENAI_PATHS as PATHS

log = logging.getLogger(__name__)



def vllm_args(cfg: ServerConfig, model_dir: str) -> Namespace:
    """The arguments vLLM's own server would have parsed for this replica (`vllm serve` flags):
    vLLM's serving classes read their options from them."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    argv = ["--model", model_dir]
    if cfg.served_model_name:
        argv += ["--served-model-name", *cfg.served_model_name]
    if cfg.tool_call_parser:
        argv += ["--enable-auto-tool-choice", "--tool-call-parser", cfg.tool_call_parser]
    if cfg.reasoning_parser:
        argv += ["--reasoning-parser", cfg.reasoning_parser]
    args: Namespace = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    if cfg.reasoning_parser and getattr(args, "structured_outputs_config", None) is not None:
        args.structured_outputs_config.reasoning_parser = cfg.reasoning_parser
    return args


def _no_default_mm_lora(request: Any) -> None:
    return None


@dataclass
class OpenAIRoutes:
    app: Any  # FastAPI: vLLM's routers
    guard: OpenAIGuard  # the ASGI app to route PATHS to

    async def start(self, engine: VllmEngine, core: SamplerCore, cfg: ServerConfig, model_dir: str) -> None:
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state

        tasks = await engine.llm.get_supported_tasks()
        await init_app_state(GuardedEngineClient(engine, core), self.app.state, vllm_args(cfg, model_dir), tasks)
        # The replica's adapters (POST /v1/adapters) are what `model` may name, as they come and go.
        self.app.state.openai_serving_models.lora_requests = LoadedAdapters(core)
        # Only `model` selects an adapter. vLLM's chat routes would also pick a "default multimodal
        # LoRA": an adapter whose name equals a message content type (`text`, `image_url` -> `image`),
        # for a request naming the base model. A replica has no --default-mm-loras, and a base request
        # must never be answered by an adapter.
        for serving in vars(self.app.state)["_state"].values():
            if hasattr(serving, "_get_active_default_mm_loras"):
                serving._get_active_default_mm_loras = _no_default_mm_lora
        self.guard.ready = True
        log.info("vLLM's OpenAI-compatible routes are up: %s", ", ".join(PATHS))


def build_openai_app(core: SamplerCore, auth: APIKeyAuth) -> OpenAIRoutes:
    from fastapi import FastAPI
    from vllm.entrypoints.openai.chat_completion.api_router import router as chat
    from vllm.entrypoints.openai.completion.api_router import router as completion
    from vllm.entrypoints.openai.models.api_router import router as models
    from vllm.entrypoints.scale_out.token_in_token_out.api_router import router as tokens
    from vllm.entrypoints.serve.exception_handling.register import init_exception_handler
    from vllm.entrypoints.serve.tokenize.api_router import router as tokenize

    app = FastAPI(title="vLLM OpenAI-compatible API", openapi_url=None, docs_url=None, redoc_url=None)
    for router in (models, completion, chat, tokens, tokenize):
        app.include_router(router)
    init_exception_handler(app)

    return OpenAIRoutes(app=app, guard=OpenAIGuard(app, core, auth))
