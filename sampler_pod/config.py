"""Server configuration from command-line flags, each with a `SAMPLER_*` environment fallback."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Literal, Sequence

from pydantic import BaseModel, Field


class ServerConfig(BaseModel):
    model: str
    host: str = "0.0.0.0"
    port: int = Field(8000, ge=1, le=65535)
    engine: Literal["vllm", "fake"] = "vllm"

    # Engine options, passed straight to vLLM's AsyncEngineArgs.
    dtype: str = "auto"
    max_model_len: int | None = Field(None, ge=16)
    max_num_seqs: int = Field(128, ge=1)
    tensor_parallel_size: int = Field(1, ge=1)
    kv_cache_memory_bytes: int | None = Field(None, ge=1 << 20)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    enforce_eager: bool = False
    seed: int = 0

    # Serving policy.
    concurrent_task_limit: int = Field(128, ge=1)
    request_timeout_s: float = Field(300.0, gt=0)
    max_request_timeout_s: float = Field(3600.0, gt=0)
    max_num_samples: int = Field(64, ge=1)
    max_body_bytes: int = Field(8 << 20, ge=1024)
    future_ttl_s: float = Field(600.0, gt=0)
    load_timeout_s: float = Field(600.0, gt=0)

    startup_lock_path: Path = Path("/var/run/sampler/engine-startup.lock")
    startup_lock_timeout_s: float = Field(900.0, gt=0)

    checkpoint_roots: list[Path] = Field(default_factory=list)
    enable_lora: bool = False
    max_loras: int = Field(4, ge=1)
    max_lora_rank: int = Field(16, ge=1)

    api_key: str | None = None
    # Twinkle-client sessions expire this long after their last heartbeat (Twinkle's default: 24 h).
    twinkle_session_ttl_s: float = Field(86400.0, gt=0)
    enable_test_seams: bool = False
    log_level: str = "info"


def _env(name: str) -> str | None:
    return os.environ.get("SAMPLER_" + name.upper().replace("-", "_"))


def _env_bool(name: str) -> bool:
    return (_env(name) or "").lower() in {"1", "true", "yes", "on"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sampler_pod", description="Concurrent vLLM sampling server.")
    add = p.add_argument
    add("--model", default=_env("model"), help="local model directory or hub id")
    add("--host", default=_env("host") or "0.0.0.0")
    add("--port", type=int, default=int(_env("port") or 8000))
    add("--engine", choices=["vllm", "fake"], default=_env("engine") or "vllm")
    add("--dtype", default=_env("dtype") or "auto")
    add("--max-model-len", type=int, default=_int_env("max_model_len"))
    add("--max-num-seqs", type=int, default=_int_env("max_num_seqs") or 128)
    add("--tensor-parallel-size", type=int, default=_int_env("tensor_parallel_size") or 1)
    add("--kv-cache-memory-bytes", type=int, default=_int_env("kv_cache_memory_bytes"))
    add("--gpu-memory-utilization", type=float, default=float(_env("gpu_memory_utilization") or 0.9))
    add("--enforce-eager", action="store_true", default=_env_bool("enforce_eager"))
    add("--seed", type=int, default=_int_env("seed") or 0)
    add("--concurrent-task-limit", type=int, default=_int_env("concurrent_task_limit") or 128)
    add("--request-timeout-s", type=float, default=float(_env("request_timeout_s") or 300))
    add("--max-request-timeout-s", type=float, default=float(_env("max_request_timeout_s") or 3600))
    add("--max-num-samples", type=int, default=_int_env("max_num_samples") or 64)
    add("--future-ttl-s", type=float, default=float(_env("future_ttl_s") or 600))
    add("--load-timeout-s", type=float, default=float(_env("load_timeout_s") or 600))
    add("--startup-lock-path", default=_env("startup_lock_path") or "/var/run/sampler/engine-startup.lock")
    add("--startup-lock-timeout-s", type=float, default=float(_env("startup_lock_timeout_s") or 900))
    add("--checkpoint-root", action="append", dest="checkpoint_roots",
        default=[r for r in (_env("checkpoint_roots") or "").split(":") if r],
        help="allowed root for checkpoint/adapter paths (repeatable; env: colon-separated)")
    add("--enable-lora", action="store_true", default=_env_bool("enable_lora"))
    add("--max-loras", type=int, default=_int_env("max_loras") or 4)
    add("--max-lora-rank", type=int, default=_int_env("max_lora_rank") or 16)
    add("--api-key", default=_env("api_key"))
    add("--twinkle-session-ttl-s", type=float, default=float(_env("twinkle_session_ttl_s") or 86400))
    add("--enable-test-seams", action="store_true", default=_env_bool("enable_test_seams"),
        help="TEST ONLY: allow injecting a failure in the middle of a checkpoint write")
    add("--log-level", default=_env("log_level") or "info")
    return p


def _int_env(name: str) -> int | None:
    v = _env(name)
    return int(v) if v else None


def parse_config(argv: Sequence[str] | None = None) -> ServerConfig:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if not ns.model:
        parser.error("--model (or SAMPLER_MODEL) is required")
    return ServerConfig(**vars(ns))
