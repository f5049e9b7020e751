"""Server configuration: every flag, its default and its help, written once in `ServerConfig`.

The command-line parser is built from the model's fields (as vLLM's `cli_args.py` builds its
parser from dataclasses): field `max_num_seqs` is the flag `--max-num-seqs` and the environment
variable `SAMPLER_MAX_NUM_SEQS`. A flag wins over the environment, the environment over the
default; pydantic converts and validates all three the same way, so a bad value is refused
with the field named, whichever way it came in.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from sampler_common.flags import Flags


def _json_if_str(value: object) -> object:
    """A flag or environment variable carries JSON text; a caller building the model in Python passes
    the object itself. Either way pydantic then validates the same structure."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e})") from None


def _words_if_str(value: object) -> object:
    return value.split() if isinstance(value, str) else value


# vLLM's own `LogprobsMode` (vllm/config/model.py), spelled out here because this module never imports
# vLLM (tests/unit/test_logprobs_mode.py checks the two agree). What each value means under each
# sampling parameter: docs/guide/logprobs.md.
LogprobsMode = Literal["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]


# What `/health` reports per adapter beside its name and path (core/health.py, `AdapterEntry`): how
# it is used on this process, nothing a replacement loads.
HEALTH_ONLY_ADAPTER_FIELDS = frozenset({"in_flight", "last_used_at"})


class InitialAdapter(BaseModel):
    """One LoRA adapter a starting server loads (after its initial checkpoint). An entry of `/health`'s
    `adapters` is one as it stands (docs/reference/contract.md: what a replacement is given), so the
    use counts it also carries are dropped; any other unknown key is refused."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(..., min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._-]+$")
    path: str = Field(..., min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _drop_health_use(cls, value: object) -> object:
        if isinstance(value, dict):
            return {k: v for k, v in value.items() if k not in HEALTH_ONLY_ADAPTER_FIELDS}
        return value


class ServerConfig(BaseModel):
    model: str = Field(..., description="local model directory or hub id (required)")
    host: str = Field("0.0.0.0", description="address to listen on")
    port: int = Field(8000, ge=1, le=65535, description="port to listen on")
    engine: Literal["vllm", "fake"] = Field(
        "vllm", description="inference engine; `fake` is a deterministic stand-in for logic tests")

    # Engine options, passed straight to vLLM's AsyncEngineArgs.
    dtype: str = Field("auto", description="vLLM dtype (auto, float32, bfloat16, ...)")
    max_model_len: int | None = Field(None, ge=16, description="context length (default: the model's)")
    max_num_seqs: int = Field(128, ge=1, description="most sequences the engine runs in one batch")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs per engine")
    kv_cache_memory_bytes: int | None = Field(
        None, ge=1 << 20, description="KV cache size; always set it on CPU (vLLM otherwise reserves ~11 GiB)")
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="GPU memory share for vLLM, when --kv-cache-memory-bytes is unset")
    enforce_eager: bool = Field(False, description="no CUDA graphs / torch.compile (always on CPU)")
    seed: int = Field(0, description="engine seed (per-request seeds are separate)")
    logprobs_mode: LogprobsMode = Field(
        "raw_logprobs", description="vLLM's --logprobs-mode: what every logprob in an answer is. raw_logprobs: the "
                                    "model's log-softmax, before temperature, top-p, top-k and penalties; "
                                    "processed_logprobs: the log-probabilities of the distribution each token was "
                                    "sampled from (what an RL loop's importance ratios want); raw_logits, "
                                    "processed_logits: the logits, before or after that processing "
                                    "(docs/guide/logprobs.md)")

    # Serving policy.
    concurrent_task_limit: int = Field(
        128, ge=1, description="admitted requests at once; past it: 429 with Retry-After")
    request_timeout_s: float = Field(300.0, gt=0, description="default per-request timeout")
    max_request_timeout_s: float = Field(3600.0, gt=0, description="largest timeout_s a request may ask for")
    max_num_samples: int = Field(64, ge=1, description="largest num_samples per request")
    max_body_bytes: int = Field(8 << 20, ge=1024, description="largest request body; past it: 413")
    future_ttl_s: float = Field(600.0, gt=0, description="how long a finished future waits to be retrieved")
    max_futures: int = Field(
        4096, ge=1, description="futures held at once (running or awaiting retrieval); past it a submit gets 429")
    max_inflight_sequences: int = Field(
        4096, ge=1, description="admitted-but-unfinished sequences (prompts x num_samples, summed over requests); "
                                "past it: 429; a request larger than it alone: 400")
    load_timeout_s: float = Field(
        600.0, gt=0, description="default timeout of a checkpoint load's validation and drain (not of its write)")
    write_timeout_s: float = Field(
        600.0, gt=0, description="longest a weight write may run once it has started (past it: uncertain_weights)")

    stall_timeout_s: float = Field(
        120.0, gt=0, description="requests in the engine and no token produced for this long, or a failed canary: "
                                 "/health reports engine_stalled and /healthz fails (the kubelet restarts the "
                                 "container); generous, so a long prefill under full load never trips it")
    canary_interval_s: float = Field(
        60.0, ge=0, description="least time between two canaries (a 1-token generation run only while the engine "
                                "is idle; failing or taking longer than --stall-timeout-s counts as stalled); "
                                "0: no canary")

    startup_lock_path: Path = Field(
        Path("/var/run/sampler/engine-startup.lock"),
        description="pod-local file lock held while the engine starts (one engine starts at a time)")
    startup_lock_timeout_s: float = Field(900.0, gt=0, description="longest wait for the startup lock")
    startup_timeout_s: float | None = Field(
        None, gt=0, description="exit with code 1 when the engine start and the start-up weights load have not "
                                "finished after this long (the kubelet then restarts the container)")

    checkpoint_roots: list[Path] = Field(
        default_factory=list,
        description="allowed root for checkpoint/adapter paths (flag --checkpoint-root, repeatable; "
                    "env: colon-separated)")
    weight_transfer_backend: Literal["gloo"] | None = Field(
        None, description="accept weights pushed over the network with vLLM's weight-transfer protocol, over this "
                          "backend (gloo: CPU nodes and any node without NCCL); unset: the protocol's routes answer "
                          "400 naming `backend`")
    drop_pushed_weights: bool = Field(
        False, description="free the host-memory copy of weights pushed over the network (or caught up from a peer) "
                           "once they are written; by default it is kept (one copy of the model in host memory) so "
                           "that a peer created or restarted later can catch up from this replica (GET "
                           "/v1/weights/staged), and beside it a second copy's worth of host memory, touched in the "
                           "background from the engine's start (after a write: the copy it replaced), is where "
                           "the next push or catch-up lands; with this flag neither is kept, and each push lands in "
                           "new memory")
    enable_lora: bool = Field(False, description="serve LoRA adapters")
    max_loras: int = Field(4, ge=1, description="adapters one engine step may batch (vLLM's LoRA slots)")
    max_cpu_loras: int | None = Field(
        None, ge=1, description="adapters held loaded at once, at least --max-loras (default: --max-loras); "
                                "a load past it is refused (409), never an eviction vLLM would make on its own")
    max_lora_rank: int = Field(16, ge=1, description="largest adapter rank accepted")

    # The weights a starting server loads before it reports ready (the operator sets these on a
    # replacement pod). The state file below, when present, wins: it is newer.
    initial_checkpoint: str | None = Field(
        None, min_length=1,
        description="checkpoint to load at startup, before /readyz is ok (needs --initial-version-label)")
    initial_version_label: str | None = Field(
        None, min_length=1, max_length=200, description="version label of --initial-checkpoint or --initial-sha256")
    initial_step: int | None = Field(
        None, ge=0, description="the trainer's training step of the initial weights (reported as weights_step)")
    initial_sha256: str | None = Field(
        None, pattern=r"^[0-9a-fA-F]{64}$",
        description="model digest of the initial weights (docs/design/weights-over-network.md, 'Digests'): "
                    "without --initial-checkpoint, weights pushed over the network that this replica must get back "
                    "(from a peer, by a load naming `peers`) before it is ready; with it, what the checkpoint must "
                    "hash to")
    initial_sha256_manifest: Annotated[dict[str, str] | None, BeforeValidator(_json_if_str)] = Field(
        None, description='sha256 manifest of --initial-checkpoint, a JSON object {"file": "hex", ...}')
    initial_adapters: Annotated[list[InitialAdapter] | None, BeforeValidator(_json_if_str)] = Field(
        None, description='LoRA adapters to load at startup, a JSON list [{"name": ..., "path": ...}, ...]')
    # No default path: a fixed one is one file per machine, and two samplers on one host (or one
    # started by hand after another) would restore each other's weights. The operator always sets
    # it, on the pod's emptyDir (desired_pod.py).
    weights_state_path: Path | None = Field(
        None,
        description="where the replica records the weights it must serve (survives a container restart, "
                    "on the pod's emptyDir); read at startup, it wins over the --initial-* flags. "
                    "Unset: no state file (a restart comes back at the --initial-* flags)")

    # vLLM's OpenAI-compatible routes (sampler_pod/openai/): the `vllm serve` flags of the same names.
    served_model_name: Annotated[list[str] | None, BeforeValidator(_words_if_str)] = Field(
        None, description="the model name(s) the OpenAI-compatible routes answer to, first one in answers "
                          "(default: --model); space-separated")
    tool_call_parser: str | None = Field(
        None, min_length=1, description="vLLM tool-call parser for /v1/chat/completions (e.g. hermes); "
                                        "turns on automatic tool choice")
    reasoning_parser: str | None = Field(
        None, min_length=1, description="vLLM reasoning parser for /v1/chat/completions (e.g. deepseek_r1)")

    api_key: str | None = Field(None, description="API key required on every route but the probes")
    admin_api_key: str | None = Field(
        None, description="when set, weight and adapter changes need this key, and --api-key only samples and "
                          "reads (the admin key is accepted everywhere)")
    twinkle_session_ttl_s: float = Field(
        86400.0, gt=0, description="Twinkle-client sessions expire this long after their last heartbeat "
                                   "(Twinkle's own default: 24 h)")
    enable_test_seams: bool = Field(
        False, description="TEST ONLY: allow the test seams (a failure in the middle of a checkpoint write, "
                           "--test-hang-startup)")
    test_hang_startup: bool = Field(
        False, description="TEST ONLY (needs --enable-test-seams): engine startup never completes")
    log_level: str = Field("info", description="log level")

    @model_validator(mode="after")
    def _check_combinations(self) -> ServerConfig:
        # Flag names in the messages: these errors are read by whoever wrote the command line.
        has_weights = self.initial_checkpoint is not None or self.initial_sha256 is not None
        if self.initial_checkpoint is not None and self.initial_version_label is None:
            raise ValueError("--initial-checkpoint and --initial-version-label go together "
                             "(env SAMPLER_INITIAL_CHECKPOINT, SAMPLER_INITIAL_VERSION_LABEL)")
        if self.initial_version_label is not None and not has_weights:
            raise ValueError("--initial-version-label needs --initial-checkpoint or --initial-sha256 "
                             "(env SAMPLER_INITIAL_CHECKPOINT, SAMPLER_INITIAL_SHA256)")
        if self.initial_sha256 is not None and self.initial_version_label is None:
            raise ValueError("--initial-sha256 needs --initial-version-label (env SAMPLER_INITIAL_VERSION_LABEL)")
        if self.initial_sha256_manifest is not None and self.initial_checkpoint is None:
            raise ValueError("--initial-sha256-manifest needs --initial-checkpoint")
        if self.initial_step is not None and not has_weights:
            raise ValueError("--initial-step needs --initial-checkpoint or --initial-sha256 (env SAMPLER_INITIAL_STEP)")
        if self.initial_checkpoint is not None and not self.checkpoint_roots:
            raise ValueError("--initial-checkpoint needs a --checkpoint-root (env SAMPLER_CHECKPOINT_ROOTS)")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"--max-cpu-loras ({self.max_cpu_loras}) must be at least --max-loras ({self.max_loras}) "
                             "(env SAMPLER_MAX_CPU_LORAS, SAMPLER_MAX_LORAS)")
        if self.initial_adapters and not self.enable_lora:
            raise ValueError("--initial-adapters needs --enable-lora")
        if self.initial_adapters and not self.checkpoint_roots:
            raise ValueError("--initial-adapters needs a --checkpoint-root (env SAMPLER_CHECKPOINT_ROOTS)")
        if self.initial_adapters and len({a.name for a in self.initial_adapters}) != len(self.initial_adapters):
            raise ValueError("--initial-adapters names an adapter twice")
        if self.initial_adapters and len(self.initial_adapters) > self.lora_slots:
            raise ValueError(f"--initial-adapters names {len(self.initial_adapters)} adapters, more than "
                             f"--max-cpu-loras ({self.lora_slots}) lets this server hold")
        if self.admin_api_key is not None and self.admin_api_key == self.api_key:
            # One key for both would make every sampling client an admin, silently.
            raise ValueError("--admin-api-key must differ from --api-key (env SAMPLER_ADMIN_API_KEY, SAMPLER_API_KEY)")
        if self.test_hang_startup and not self.enable_test_seams:
            raise ValueError("--test-hang-startup needs --enable-test-seams")
        return self

    @property
    def lora_slots(self) -> int:
        """Adapters this server holds at once: vLLM's `max_cpu_loras` (0 without --enable-lora)."""
        if not self.enable_lora:
            return 0
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


FLAGS = Flags(ServerConfig, prog="python -m sampler_pod", description="Concurrent vLLM sampling server.",
              env_prefix="SAMPLER_", flag_names={"checkpoint_roots": "--checkpoint-root"}, list_separator=":")


def parse_config(argv: Sequence[str] | None = None, environ: dict[str, str] | None = None) -> ServerConfig:
    return FLAGS.parse(argv, environ)
