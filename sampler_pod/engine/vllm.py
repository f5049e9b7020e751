"""The vLLM engine: `engine.base.Engine` over vLLM's `AsyncLLM`.

The only module that imports vLLM at run time (imports stay inside functions, so the
fake engine and the unit tests never pay for importing vLLM).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import os
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any, get_args

from ..config import ServerConfig
from .base import (
    AdapterRef,
    CacheState,
    DigestMismatch,
    EngineDead,
    EngineRejected,
    EngineStep,
    FinishReason,
    GenerationOutput,
    GenerationSpec,
    InFlightWrite,
    KeptWeights,
    KvMode,
    NothingWritten,
    SequenceOutput,
    StagedCheckpoint,
    TensorMeta,
    TransferProgress,
    TransferReceived,
    TransferTorn,
    VersionSpan,
)

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------- vLLM


def start_async_llm(args: Any, stat_loggers: list[Any] | None = None) -> Any:
    """`AsyncLLM` from engine args; on the CPU backend, laid out as vLLM lays it out on a GPU.

    On a GPU, one device's model runs inside the engine-core process. The CPU backend runs it in a
    third process (its `mp` executor) unless VLLM_ENABLE_V1_MULTIPROCESSING is 0, and each model
    step then hands off HTTP -> engine core -> worker and back. On a small CPU node those hand-offs
    wait on shared cores and throughput collapsed in some runs to a fifth; with the model in the
    engine core it does not (docs/benchmarks.md, "Sampling concurrency"). `AsyncLLM`'s engine core
    is a process either way. The model's OpenMP threads are bound exactly as vLLM binds its worker's
    (`VLLM_CPU_OMP_THREADS_BIND`: auto, a core list, or nobind): unbound, every engine on a node
    would run a thread per core of the node. A value of VLLM_ENABLE_V1_MULTIPROCESSING set in the
    environment wins (1: vLLM's default layout).
    """
    from vllm.platforms import current_platform
    from vllm.utils.ompmultiprocessing import OMPProcessManager
    from vllm.v1.engine.async_llm import AsyncLLM

    if current_platform.is_cpu() and args.tensor_parallel_size == 1:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    config = args.create_engine_config()
    in_core = current_platform.is_cpu() and config.parallel_config.distributed_executor_backend == "uni"
    # The engine core is spawned inside: it inherits the OpenMP environment its worker would have had.
    with OMPProcessManager(config).configure_omp_envs(0, 0) if in_core else contextlib.nullcontext():
        return AsyncLLM.from_vllm_config(config, enable_log_requests=args.enable_log_requests,
                                         disable_log_stats=args.disable_log_stats, stat_loggers=stat_loggers)


def cache_vllm_envs() -> None:
    """Freeze vLLM's environment variables for the rest of this process, as vLLM's engine core and
    workers do once they are up (`enable_envs_cache`).

    `vllm.envs.X` otherwise calls `os.getenv` on every read, and the output handler in THIS process
    reads some per sequence per engine step (`IterationStats.update_from_output` reads
    VLLM_COMPUTE_NANS_IN_LOGITS): ~7% of the server's CPU under load (py-spy, docs/benchmarks.md).
    vLLM's own API server leaves them uncached. Safe here because a server process runs one engine
    and never changes vLLM's environment once the engine is up (VLLM_RPC_BASE_PATH and the OpenMP
    variables are set before)."""
    from vllm import envs

    envs.enable_envs_cache()


@dataclass
class EngineCounters:
    """What this server reads from vLLM's per-step stats (`engine_stats_logger`)."""

    # Tokens the engine has produced, prompts and samples (`Engine.tokens_produced`).
    tokens: int = 0
    # The last steps' batch make-up (`Engine.recent_steps`), kept only with the test seams on.
    steps: collections.deque[EngineStep] | None = None
    # The scheduler's queue and KV use at the last step (`Engine.cache_state`).
    waiting: int = 0
    usage: float = 0.0


def engine_stats_logger(counters: EngineCounters) -> Any:
    """A vLLM stat-logger factory that adds each engine step's prompt and generated tokens to `counters`,
    and with the test seams on, notes the step's batch make-up.

    The cheapest exact progress signal there is: vLLM already builds these per-step stats (log stats
    are on by default) and calls every logger once per step that produced output, in the output
    handler's task; this adds an addition to that call. The sampling path itself is untouched: it
    asks for FINAL_ONLY outputs, so it never sees tokens before a sequence ends. Prompt tokens count
    too, so a prefill finishing is progress (vLLM reports them when a request's prefill completes).
    The batch make-up is vLLM's own count: the scheduler's running requests, and its running
    requests per LoRA adapter (the numbers behind vLLM's `vllm:lora_requests_info` metric). The
    queue and the KV use are the scheduler's too (`vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`).
    """
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _Counter(StatLoggerBase):  # type: ignore[misc]  # vLLM is untyped here
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                   engine_idx: int = 0) -> None:
            if iteration_stats is not None:
                counters.tokens += iteration_stats.num_generation_tokens + iteration_stats.num_prompt_tokens
            if scheduler_stats is not None:
                counters.waiting = scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs
                counters.usage = scheduler_stats.kv_cache_usage
            if counters.steps is not None and scheduler_stats is not None:
                counters.steps.append(EngineStep(running=scheduler_stats.num_running_reqs,
                                                 adapters=dict(scheduler_stats.running_lora_adapters)))

        def log_engine_initialized(self) -> None:
            pass

    return lambda vllm_config, engine_index: _Counter(vllm_config, engine_index)


def weights_salt(version: int, client_salt: str | None) -> str:
    """The prefix-cache salt of a request sent under weights `version`: blocks computed under other
    weights are never reused. A client's own `cache_salt` (prime-rl sends its policy version) still
    separates its requests from others' under the same weights."""
    return f"w{version}" if not client_salt else f"w{version}:{client_salt}"


# How many engine steps the test seams' trace keeps.
TRACED_STEPS = 1024


def _open_gate() -> asyncio.Event:
    gate = asyncio.Event()
    gate.set()
    return gate


# How often a keep-mode load checks whether the worker has finished reading its checkpoint.
STAGE_POLL_S = 0.01
# The longest wait between two looks at a push being received (`receive_poll_s`).
MAX_RECEIVE_POLL_S = 0.1


def receive_poll_s(done: int, total: int, elapsed_s: float) -> float:
    """How long to wait before the next look at a push being received: half of what the rest should take
    at the rate so far, within [STAGE_POLL_S, MAX_RECEIVE_POLL_S]; STAGE_POLL_S before the first byte and
    after the last. Each look is an RPC through the engine core (a few ms of CPU in two processes): at
    STAGE_POLL_S throughout, a push of a few seconds spent a third of the replica's CPU on looking."""
    if done <= 0 or done >= total:
        return STAGE_POLL_S
    rest_s = elapsed_s * (total - done) / done
    return min(MAX_RECEIVE_POLL_S, max(STAGE_POLL_S, rest_s / 2))


@dataclass
class VllmWeightReceiver:
    """`WeightReceiver` over the workers' transfer engines (`worker_extension.py`, `sampler_transfer_*`):
    each call starts the work in every worker and returns at once there, then this side reads the workers'
    status between engine steps until they are done, as a keep-mode stage does (`STAGE_POLL_S`)."""

    llm: Any
    backend: str
    workers: int
    _progress: TransferProgress = field(default_factory=lambda: TransferProgress(0, 0))

    async def _rpc(self, method: str, **kwargs: Any) -> list[Any]:
        return list(await self.llm.collective_rpc(method, kwargs=kwargs))

    async def _until(self, phase: str) -> list[dict[str, Any]]:
        t0 = time.monotonic()
        while True:
            states = await self._rpc("sampler_transfer_status")
            self._progress = TransferProgress(bytes=min(s["bytes"] for s in states),
                                              total_bytes=max(s["total_bytes"] for s in states))
            failed = [s for s in states if s["phase"] == "failed"]
            if failed:
                f = failed[0]
                if f["failure"] == "sha256_mismatch":
                    raise DigestMismatch(f["error"], f["tensor"])
                raise TransferTorn(f["error"])
            if all(s["phase"] == phase for s in states):
                return states
            progress = self._progress
            await asyncio.sleep(receive_poll_s(progress.bytes, progress.total_bytes, time.monotonic() - t0))

    async def join(self, init_info: dict[str, Any]) -> None:
        await self._rpc("sampler_transfer_init", init_info=init_info)
        await self._until("joined")

    async def prepare(self, nbytes: int) -> None:
        await self._rpc("sampler_transfer_prepare", nbytes=nbytes)

    async def begin(self) -> None:
        await self._rpc("sampler_transfer_begin")

    async def receive(self, update_info: dict[str, Any]) -> TransferReceived:
        await self._rpc("sampler_transfer_receive", update_info=update_info)
        try:
            done = (await self._until("received"))[0]
        finally:
            self._progress = TransferProgress(0, 0)
        return TransferReceived(tensors=done["tensors"], total_bytes=done["total_bytes"], sha256=done["sha256"])

    def progress(self) -> TransferProgress:
        return self._progress

    async def stage(self) -> StagedCheckpoint:
        key = uuid.uuid4().hex
        counts = await self._rpc("sampler_transfer_stage", key=key)
        return StagedCheckpoint(key=key, tensors=int(counts[0]), files=())

    async def discard(self) -> None:
        await self._rpc("sampler_transfer_discard")

    async def shutdown(self) -> None:
        await self._rpc("sampler_transfer_shutdown")


@dataclass
class VllmEngine:
    """Weights versions: vLLM tags every engine step's tokens with the engine core's weight version
    (`set_weight_version`, changed only while generation is paused) and reports, per finished
    sequence, the spans of tokens each version produced. This server sets it to its own weights
    version counter at every write, so spans come from the engine, exact, at no cost per request.

    Prefix cache: every request carries `cache_salt` = the weights version it was sent under, so a
    prompt never reuses blocks computed under other weights. `reset_prefix_cache` alone is not
    enough: it refuses (returns False) while requests hold blocks, which is exactly the state of a
    keep-mode load. The salt must match the weights the request's prefill runs under, so a keep-mode
    write closes a gate first: requests not yet sent wait for the new salt, and the pause is sent
    only after every request that passed the gate has reached the engine (zmq keeps their order).
    """

    llm: Any  # vllm.v1.engine.async_llm.AsyncLLM
    vocab_size: int
    max_model_len: int
    tokenizer: Any
    version: int = 0
    _gate: asyncio.Event = field(default_factory=_open_gate)
    _sending: int = 0
    _sent: asyncio.Event = field(default_factory=_open_gate)
    # Set when a keep-mode write failed: the engine is paused on half-written weights for good.
    _broken: str | None = None
    _counters: EngineCounters = field(default_factory=EngineCounters)
    _receiver: VllmWeightReceiver | None = None
    # The prefix cache's block size (None: prefix caching off) and the KV cache's blocks, as the engine
    # was built (`cache_state`).
    _block_size: int | None = None
    _blocks: int | None = None

    @classmethod
    def create(cls, model_dir: str, cfg: ServerConfig) -> VllmEngine:
        """Blocking: spawns the engine core and waits until it is ready (~15 s for the tiny model on CPU)."""
        # A per-process RPC dir: vLLM's IPC socket files otherwise pile up in /tmp.
        os.environ.setdefault("VLLM_RPC_BASE_PATH", tempfile.mkdtemp(prefix="sampler-vllm-rpc-"))
        from vllm.config.weight_transfer import WeightTransferConfig
        from vllm.engine.arg_utils import AsyncEngineArgs

        backend = cfg.weight_transfer_backend
        args = AsyncEngineArgs(
            model=model_dir,
            dtype=cfg.dtype,
            max_model_len=cfg.max_model_len,
            max_num_seqs=cfg.max_num_seqs,
            tensor_parallel_size=cfg.tensor_parallel_size,
            kv_cache_memory_bytes=cfg.kv_cache_memory_bytes,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            enforce_eager=cfg.enforce_eager,
            seed=cfg.seed,
            enable_lora=cfg.enable_lora,
            max_loras=cfg.max_loras,
            # The server refuses an add past it (weights/service.py): vLLM's own LRU never evicts.
            max_cpu_loras=cfg.max_cpu_loras,
            max_lora_rank=cfg.max_lora_rank,
            # What every logprob is (vLLM's sampler computes them so): named in every answer from the flag.
            logprobs_mode=cfg.logprobs_mode,
            worker_extension_cls="sampler_pod.engine.worker_extension.WeightLoaderExtension",
            # Each worker builds its transfer engine from vLLM's factory (the worker extension registers gloo).
            weight_transfer_config=WeightTransferConfig(backend=backend) if backend else None,
            enable_log_requests=False,
        )
        counters = EngineCounters(steps=collections.deque(maxlen=TRACED_STEPS) if cfg.enable_test_seams else None)
        llm = start_async_llm(args, stat_loggers=[engine_stats_logger(counters)])
        cache_vllm_envs()
        mc = llm.model_config
        if mc.logprobs_mode != cfg.logprobs_mode:  # answers name the flag's mode: it must be the engine's
            llm.shutdown()
            raise RuntimeError(f"vLLM runs logprobs_mode {mc.logprobs_mode}, not --logprobs-mode {cfg.logprobs_mode}")
        # The tokenizer (and its chat template) is loaded here, once, never per request.
        tokenizer = llm.get_tokenizer()
        receiver = VllmWeightReceiver(llm, backend, workers=llm.vllm_config.parallel_config.world_size_across_dp) \
            if backend else None
        cache = llm.vllm_config.cache_config
        return cls(llm=llm, vocab_size=mc.get_vocab_size(), max_model_len=mc.max_model_len, tokenizer=tokenizer,
                   _counters=counters, _receiver=receiver,
                   _block_size=int(cache.block_size) if cache.enable_prefix_caching else None,
                   _blocks=int(cache.num_gpu_blocks) if cache.num_gpu_blocks else None)

    @property
    def weight_receiver(self) -> VllmWeightReceiver | None:
        return self._receiver

    async def require_lora_isolation(self) -> None:
        """Refuse --enable-lora where a request without an adapter could be answered by one
        (`lora_isolation`): every worker must report its LoRA path isolated."""
        problems = [p for p in await self.llm.collective_rpc("sampler_lora_isolation") if p]
        if problems:
            raise RuntimeError(f"--enable-lora refused: {problems[0]}")

    async def keep_stream_buffers(self) -> None:
        """Fix each worker process's malloc thresholds (sampler_common/heap.py): a catch-up's slices pass
        through them."""
        await self.llm.collective_rpc("sampler_keep_stream_buffers")

    async def require_seeded_chunks(self) -> None:
        """Refuse to serve where a seeded request prefilled in chunks would kill the engine
        (`seeded_chunks`): every worker must report its generators' rewind safe."""
        problems = [p for p in await self.llm.collective_rpc("sampler_seeded_chunks") if p]
        if problems:
            raise RuntimeError(f"engine refused: {problems[0]}")

    def _sampling_params(self, spec: GenerationSpec) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            n=spec.n,
            max_tokens=spec.max_tokens,
            temperature=spec.temperature,
            top_p=spec.top_p,
            top_k=spec.top_k if spec.top_k > 0 else 0,
            seed=spec.seed,
            stop=list(spec.stop) or None,
            stop_token_ids=list(spec.stop_token_ids) or None,
            ignore_eos=spec.ignore_eos,
            # 0 still returns the sampled token's own logprob, which every sample reports.
            logprobs=spec.logprobs,
            prompt_logprobs=spec.topk_prompt_logprobs if spec.prompt_logprobs else None,
            # Stop strings need text; otherwise skip detokenization (CPU the engine could use).
            detokenize=bool(spec.stop),
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    async def generate(self, request_id: str, prompt: list[int], spec: GenerationSpec,
                       adapter: AdapterRef | None) -> GenerationOutput:
        from vllm.inputs import TokensPrompt
        from vllm.lora.request import LoRARequest

        lora = LoRARequest(adapter.name, adapter.lora_id, adapter.path) if adapter else None
        # vLLM refuses n > 1 with greedy sampling; greedy samples are identical by
        # definition, so compute one and hand out n copies.
        copies, run_spec = (spec.n, replace(spec, n=1)) if spec.temperature == 0 and spec.n > 1 else (1, spec)
        final = None
        async for out in self.stream(request_id, TokensPrompt(prompt_token_ids=prompt),
                                     self._sampling_params(run_spec), lora_request=lora):
            final = out
        assert final is not None
        result = _convert(prompt, run_spec, final, self.version)
        if copies > 1:
            result.sequences = [replace(result.sequences[0]) for _ in range(copies)]
        return result

    async def stream(self, request_id: str, prompt: Any, params: Any, **kwargs: Any) -> AsyncIterator[Any]:
        """`AsyncLLM.generate` for this server's requests, native and OpenAI alike: the weights' salt
        is set on the prompt (combined with a client's own `cache_salt`), and a keep-mode write's gate
        is passed first. Yields vLLM's `RequestOutput`s; aborts the request when the caller goes away.
        Engine failures come out as `EngineDead` / `EngineRejected`."""
        from vllm.exceptions import VLLMClientError
        from vllm.outputs import STREAM_FINISHED
        from vllm.v1.engine.exceptions import EngineDeadError

        if not self._gate.is_set():
            await self._gate.wait()
        if self._broken is not None:
            raise EngineDead(self._broken)
        prompt["cache_salt"] = weights_salt(self.version, prompt.get("cache_salt"))
        # `AsyncLLM.generate` less its generator: the same calls, but this side knows when the
        # request has been sent (the keep-mode gate above needs it).
        self._sending += 1
        self._sent.clear()
        try:
            q = await self.llm.add_request(request_id, prompt, params, **kwargs)
        except EngineDeadError as e:
            raise EngineDead(str(e) or "engine core died") from e
        except VLLMClientError as e:  # vLLM's own request validation: the client's fault
            raise EngineRejected(str(e)) from e
        finally:
            self._sending -= 1
            if not self._sending:
                self._sent.set()
        try:
            while True:
                # Drain without an await when an output is already there, as vLLM's generate does.
                out = q.get_nowait() or await q.get()
                if out is not STREAM_FINISHED:
                    yield out
                if out.finished:
                    break
        except (asyncio.CancelledError, GeneratorExit):
            await self.llm.abort(q.request_id, internal=True)
            raise
        except EngineDeadError as e:
            raise EngineDead(str(e) or "engine core died") from e
        except VLLMClientError as e:
            raise EngineRejected(str(e)) from e
        finally:
            q.close()

    async def abort(self, request_id: str) -> None:
        await self.llm.abort(request_id)

    async def load_checkpoint(self, files: list[str], fail_after_tensors: int | None, version: int) -> int:
        return await self._written(await self.llm.collective_rpc(
            "sampler_load_checkpoint", kwargs={"files": files, "fail_after_tensors": fail_after_tensors}), version)

    async def load_staged(self, staged: StagedCheckpoint, version: int) -> int:
        return await self._written(await self.llm.collective_rpc(
            "sampler_load_staged", kwargs={"key": staged.key, "fail_after_tensors": None, "keep": staged.keep}),
            version)

    # -- the kept copy and a peer's (worker_extension.py, `sampler_kept_*`, `sampler_incoming_*`). Every
    # worker holds a whole copy (each loads its own shard of it); reads take the first worker's.

    async def kept(self) -> KeptWeights | None:
        meta = (await self.llm.collective_rpc("sampler_kept_meta"))[0]
        if meta is None:
            return None
        sha256, tensors = meta
        return KeptWeights(str(sha256), tuple(TensorMeta(str(n), str(d), tuple(int(x) for x in shape), int(b))
                                              for n, d, shape, b in tensors))

    async def read_kept(self, sha256: str, offset: int, length: int) -> bytes:
        try:
            data = await self.llm.collective_rpc("sampler_kept_read", kwargs={"sha256": sha256, "offset": offset,
                                                                              "length": length})
        except Exception as e:
            raise KeyError(str(e)) from e
        return bytes(data[0])

    async def stage_kept(self, sha256: str) -> StagedCheckpoint:
        key = uuid.uuid4().hex
        counts = await self.llm.collective_rpc("sampler_kept_stage", kwargs={"key": key, "sha256": sha256})
        return StagedCheckpoint(key=key, tensors=int(counts[0]), files=(), keep=sha256)

    async def stage_incoming(self, tensors: list[TensorMeta]) -> StagedCheckpoint:
        key = uuid.uuid4().hex
        await self.llm.collective_rpc("sampler_incoming_begin", kwargs={
            "key": key, "tensors": [(t.name, t.dtype, list(t.shape), t.nbytes) for t in tensors]})
        return StagedCheckpoint(key=key, tensors=len(tensors), files=())

    async def write_incoming(self, staged: StagedCheckpoint, offset: int, data: bytes) -> None:
        await self.llm.collective_rpc("sampler_incoming_write", kwargs={"key": staged.key, "offset": offset,
                                                                        "data": data})

    async def seal_incoming(self, staged: StagedCheckpoint, keep: str | None) -> StagedCheckpoint:
        counts = await self.llm.collective_rpc("sampler_incoming_seal", kwargs={"key": staged.key})
        return replace(staged, tensors=int(counts[0]), keep=keep)

    async def _written(self, counts: list[Any], version: int) -> int:
        """After a write with nothing in flight: tag the new weights, and drop the old ones' prefixes."""
        await self._set_version(version)
        # Cached prefixes were computed with the old weights (the salt already keeps them apart;
        # nothing is in flight here, so this frees their blocks too).
        await self.llm.reset_prefix_cache()
        return int(counts[0])

    async def _set_version(self, version: int) -> None:
        await self.llm.engine_core.set_weight_version_async(str(version))
        self.version = version

    @property
    def keep_unsupported(self) -> str | None:
        from vllm.v1.engine import PauseMode

        if "keep" not in get_args(PauseMode):
            return "this vLLM build has no keep-mode pause (pause_generation(mode='keep'))"
        if not hasattr(self.llm.engine_core, "set_weight_version_async"):
            return "this vLLM build cannot tag tokens with a weights version (set_weight_version)"
        return None

    async def stage_checkpoint(self, files: list[str]) -> StagedCheckpoint:
        key = uuid.uuid4().hex
        await self.llm.collective_rpc("sampler_stage_begin", kwargs={"key": key, "files": files})
        try:
            # The worker reads in a thread; each check is one short RPC between engine steps.
            while True:
                states = await self.llm.collective_rpc("sampler_stage_done", kwargs={"key": key})
                if all(done for done, _, _ in states):
                    break
                await asyncio.sleep(STAGE_POLL_S)
            errors = [err for _, _, err in states if err]
            if errors:
                raise RuntimeError(f"could not read the checkpoint: {errors[0]}")
        except BaseException:
            await self.discard_staged(StagedCheckpoint(key=key, tensors=0, files=tuple(files)))
            raise
        return StagedCheckpoint(key=key, tensors=int(states[0][1]), files=tuple(files))

    async def discard_staged(self, staged: StagedCheckpoint) -> None:
        with contextlib.suppress(Exception):  # a dead engine holds nothing to free
            await self.llm.collective_rpc("sampler_stage_discard", kwargs={"key": staged.key})
            await self.llm.collective_rpc("sampler_incoming_discard", kwargs={"key": staged.key})

    async def load_in_flight(self, staged: StagedCheckpoint, version: int, kv: KvMode,
                             fail_after_tensors: int | None) -> InFlightWrite:
        self._gate.clear()
        try:
            await self._sent.wait()  # every request that passed the gate reached the engine
            t0 = time.monotonic()
            # recompute: vLLM resets the caches with the running requests (they are preempted and
            # recompute their KV, prompt and tokens so far, on the new weights when resumed).
            # (AsyncLLM.pause_generation adds a 20 ms sleep for tidier logs: not in the pause.)
            try:
                await self.llm.engine_core.pause_scheduler_async(mode="keep", clear_cache=kv == "recompute")
            except Exception as e:  # e.g. the cache reset of `recompute` refused: nothing written yet
                with contextlib.suppress(Exception):
                    await self.llm.resume_generation()
                raise NothingWritten(f"the engine could not pause for the write: {type(e).__name__}: {e}") from e
            try:
                counts = await self.llm.collective_rpc(
                    "sampler_load_staged", kwargs={"key": staged.key, "fail_after_tensors": fail_after_tensors,
                                                   "keep": staged.keep})
                await self._set_version(version)
            except BaseException as e:
                self._broken = f"weights half-written by a failed in-flight load: {type(e).__name__}: {e}"
                raise
            await self.llm.resume_generation()
            return InFlightWrite(tensors=int(counts[0]), paused_s=time.monotonic() - t0)
        finally:
            self._gate.set()

    async def pause(self) -> None:
        # "keep": frozen requests stay queued and resume where they were (vLLM's RL pause).
        await self.llm.engine_core.pause_scheduler_async(mode="keep", clear_cache=False)
        # The engine's last outputs came before the pause's reply, but are processed by another task:
        # once its queue is empty, `progress()` counts every token generated before the pause.
        while not self.llm.engine_core.outputs_queue.empty():
            await asyncio.sleep(0)

    async def resume(self) -> None:
        await self.llm.resume_generation()

    def held_requests(self) -> int:
        return int(self.llm.get_num_unfinished_requests())

    def progress(self) -> dict[str, int]:
        # The output processor's view: tokens it has received from the engine core per request.
        # (n > 1: each sequence is a child request under the same external id.)
        counts: dict[str, int] = {}
        for state in self.llm.output_processor.request_states.values():
            rid = state.external_req_id
            counts[rid] = counts.get(rid, 0) + (state.detokenizer.num_output_tokens() if state.detokenizer else 0)
        return counts

    def tokens_produced(self) -> int:
        return self._counters.tokens

    def recent_steps(self) -> list[EngineStep]:
        return list(self._counters.steps or ())

    def cache_state(self) -> CacheState:
        c = self._counters
        # The last step's stats outlive its requests: an engine holding none queues none and uses no block
        # (a freed block that keeps its prefix cached is free to vLLM too).
        idle = not self.llm.get_num_unfinished_requests()
        return CacheState(self._block_size, self._blocks, 0 if idle else c.waiting, 0.0 if idle else c.usage)

    async def add_adapter(self, ref: AdapterRef) -> None:
        from vllm.lora.request import LoRARequest

        if not await self.llm.add_lora(LoRARequest(ref.name, ref.lora_id, ref.path)):
            raise RuntimeError(f"engine refused adapter {ref.name}")

    async def remove_adapter(self, ref: AdapterRef) -> None:
        await self.llm.remove_lora(ref.lora_id)

    @property
    def dead_reason(self) -> str | None:
        if self.llm.errored:
            return f"engine core is dead: {self.llm.dead_error!r}"
        return self._broken

    async def shutdown(self) -> None:
        await asyncio.to_thread(self.llm.shutdown)


def version_spans(c: Any, ntokens: int, current: int) -> list[VersionSpan]:
    """vLLM's weight-version spans of one sequence, as this server's version numbers. An empty
    sequence has no span in vLLM: it gets one empty span at the engine's current version."""
    spans = [VersionSpan(version=int(w.version) if w.version != "default" else 0, start=w.start, end=w.end)
             for w in c.weight_versions or ()]
    return spans or [VersionSpan(version=current, start=0, end=ntokens)]


def _convert(prompt: list[int], spec: GenerationSpec, out: Any, current_version: int) -> GenerationOutput:
    seqs = []
    for c in out.outputs:
        tokens = list(c.token_ids)
        lps: list[float] = []
        tops: list[dict[int, float]] | None = [] if spec.logprobs > 0 else None
        for i, t in enumerate(tokens):
            d = c.logprobs[i] if c.logprobs is not None else {}
            lps.append(float(d[t].logprob) if t in d else float("nan"))
            if tops is not None:
                # Under a processed_* mode, the tokens top-k and top-p masked out are at -inf: they are no
                # alternative of the distribution the token was drawn from (and -inf is no JSON number).
                tops.append({int(k): float(v.logprob) for k, v in d.items()
                             if v.rank is not None and v.rank <= spec.logprobs and v.logprob != -math.inf})
        reason: FinishReason = c.finish_reason if c.finish_reason in ("stop", "length") else "abort"
        seqs.append(SequenceOutput(tokens=tokens, logprobs=lps, finish_reason=reason, top_logprobs=tops,
                                   spans=version_spans(c, len(tokens), current_version)))
    plp: list[float | None] | None = None
    topk: list[dict[int, float] | None] | None = None
    if spec.prompt_logprobs and out.prompt_logprobs is not None:
        plp, topk = [], ([] if spec.topk_prompt_logprobs > 0 else None)
        for i, d in enumerate(out.prompt_logprobs):
            if d is None:
                plp.append(None)
                if topk is not None:
                    topk.append(None)
                continue
            t = prompt[i]
            plp.append(float(d[t].logprob) if t in d else None)
            if topk is not None:
                topk.append({int(k): float(v.logprob) for k, v in d.items()
                             if v.rank is not None and v.rank <= spec.topk_prompt_logprobs})
    return GenerationOutput(sequences=seqs, prompt_logprobs=plp, topk_prompt_logprobs=topk)
