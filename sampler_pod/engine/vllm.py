"""The vLLM engine: `engine.base.Engine` over vLLM's `AsyncLLM`.

The only module that imports vLLM at run time (imports stay inside functions, so the
fake engine and the unit tests never pay for importing vLLM).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
from dataclasses import dataclass, replace
from typing import Any

from ..config import ServerConfig
from .base import AdapterRef, EngineDead, EngineRejected, FinishReason, GenerationOutput, GenerationSpec, SequenceOutput

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------- vLLM


def start_async_llm(args: Any) -> Any:
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
                                         disable_log_stats=args.disable_log_stats)


@dataclass
class VllmEngine:
    llm: Any  # vllm.v1.engine.async_llm.AsyncLLM
    vocab_size: int
    max_model_len: int
    tokenizer: Any

    @classmethod
    def create(cls, model_dir: str, cfg: ServerConfig) -> VllmEngine:
        """Blocking: spawns the engine core and waits until it is ready (~15 s for the tiny model on CPU)."""
        # A per-process RPC dir: vLLM's IPC socket files otherwise pile up in /tmp.
        os.environ.setdefault("VLLM_RPC_BASE_PATH", tempfile.mkdtemp(prefix="sampler-vllm-rpc-"))
        from vllm.engine.arg_utils import AsyncEngineArgs

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
            max_lora_rank=cfg.max_lora_rank,
            worker_extension_cls="sampler_pod.engine.worker_extension.WeightLoaderExtension",
            enable_log_requests=False,
        )
        llm = start_async_llm(args)
        mc = llm.model_config
        # The tokenizer (and its chat template) is loaded here, once, never per request.
        tokenizer = llm.get_tokenizer()
        return cls(llm=llm, vocab_size=mc.get_vocab_size(), max_model_len=mc.max_model_len, tokenizer=tokenizer)

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
        from vllm.exceptions import VLLMClientError
        from vllm.inputs import TokensPrompt
        from vllm.lora.request import LoRARequest
        from vllm.v1.engine.exceptions import EngineDeadError

        lora = LoRARequest(adapter.name, adapter.lora_id, adapter.path) if adapter else None
        # vLLM refuses n > 1 with greedy sampling; greedy samples are identical by
        # definition, so compute one and hand out n copies.
        copies, run_spec = (spec.n, replace(spec, n=1)) if spec.temperature == 0 and spec.n > 1 else (1, spec)
        final = None
        try:
            async for out in self.llm.generate(TokensPrompt(prompt_token_ids=prompt),
                                               self._sampling_params(run_spec), request_id, lora_request=lora):
                final = out
        except EngineDeadError as e:
            raise EngineDead(str(e) or "engine core died") from e
        except VLLMClientError as e:  # vLLM's own request validation: the client's fault
            raise EngineRejected(str(e)) from e
        assert final is not None
        result = _convert(prompt, run_spec, final)
        if copies > 1:
            result.sequences = [replace(result.sequences[0]) for _ in range(copies)]
        return result

    async def abort(self, request_id: str) -> None:
        await self.llm.abort(request_id)

    async def load_checkpoint(self, files: list[str], fail_after_tensors: int | None) -> int:
        counts = await self.llm.collective_rpc(
            "sampler_load_checkpoint", kwargs={"files": files, "fail_after_tensors": fail_after_tensors}
        )
        # Cached prefixes were computed with the old weights.
        await self.llm.reset_prefix_cache()
        return int(counts[0])

    async def pause(self) -> None:
        # "keep": frozen requests stay queued and resume where they were (vLLM's RL pause).
        await self.llm.pause_generation(mode="keep", clear_cache=False)

    async def resume(self) -> None:
        await self.llm.resume_generation()

    def held_requests(self) -> int:
        return int(self.llm.get_num_unfinished_requests())

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
        return None

    async def shutdown(self) -> None:
        await asyncio.to_thread(self.llm.shutdown)


def _convert(prompt: list[int], spec: GenerationSpec, out: Any) -> GenerationOutput:
    seqs = []
    for c in out.outputs:
        tokens = list(c.token_ids)
        lps: list[float] = []
        tops: list[dict[int, float]] | None = [] if spec.logprobs > 0 else None
        for i, t in enumerate(tokens):
            d = c.logprobs[i] if c.logprobs is not None else {}
            lps.append(float(d[t].logprob) if t in d else float("nan"))
            if tops is not None:
                tops.append(
                    {int(k): float(v.logprob) for k, v in d.items() if v.rank is not None and v.rank <= spec.logprobs}
                )
        reason: FinishReason = c.finish_reason if c.finish_reason in ("stop", "length") else "abort"
        seqs.append(SequenceOutput(tokens=tokens, logprobs=lps, finish_reason=reason, top_logprobs=tops))
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
