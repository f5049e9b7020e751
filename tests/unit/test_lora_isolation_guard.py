"""--enable-lora is refused at start unless every engine worker reports its LoRA path isolated
(sampler_pod/engine/lora_isolation.py; the real engine's side: tests/engine/test_lora_isolation_*.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from sampler_pod.engine.vllm import VllmEngine


class Workers:
    """An AsyncLLM stand-in: what each worker answers to the isolation question."""

    def __init__(self, *answers: str | None) -> None:
        self.answers = list(answers)
        self.calls: list[str] = []

    async def collective_rpc(self, method: str, **_: Any) -> list[str | None]:
        self.calls.append(method)
        return self.answers


def engine(llm: Workers) -> VllmEngine:
    return VllmEngine(llm=llm, vocab_size=512, max_model_len=512, tokenizer=None)


def test_every_worker_isolated_starts() -> None:
    workers = Workers(None, None)
    asyncio.run(engine(workers).require_lora_isolation())
    assert workers.calls == ["sampler_lora_isolation"]


def test_one_worker_not_isolated_refuses_naming_the_flag() -> None:
    why = "LoRA isolation is unverified for vLLM's vllm.lora.punica_wrapper.punica_xpu.PunicaWrapperXPU"
    with pytest.raises(RuntimeError, match="^--enable-lora refused: LoRA isolation is unverified .*XPU"):
        asyncio.run(engine(Workers(None, why)).require_lora_isolation())
