"""vLLM worker extension: hot weight reload inside the worker process.

Loaded by vLLM via `worker_extension_cls="sampler_pod.engine.worker_extension.WeightLoaderExtension"`;
its methods are called with `AsyncLLM.collective_rpc(name, kwargs=...)`. Tensors do not
survive that RPC, so the worker reads the (already validated) files itself.

Why not `model.load_weights()`: on CPU the linear weights are repacked after load, so
only `reload_weights` (which restores checkpoint layout, loads, and re-runs weight
post-processing) works. A failure inside it leaves parameters half-written: that is
exactly the "uncertain weights" state the server reports.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch


class InjectedWriteFailure(RuntimeError):
    """Raised by the documented test seam `fail_after_tensors`; never in production paths."""


def _stream_tensors(files: list[str], fail_after_tensors: int | None) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    written = 0
    for path in files:
        # One tensor at a time: a checkpoint never has to fit in memory twice.
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if fail_after_tensors is not None and written >= fail_after_tensors:
                    raise InjectedWriteFailure(f"test seam: failing after {written} tensors were written")
                yield name, f.get_tensor(name)
                written += 1


class WeightLoaderExtension:
    # `self` is the vLLM worker; these are its attributes.
    reload_weights: Any
    model_runner: Any

    def sampler_load_checkpoint(self, files: list[str], fail_after_tensors: int | None = None) -> int:
        count = 0

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal count
            for item in _stream_tensors(files, fail_after_tensors):
                count += 1
                yield item

        self.reload_weights(weights_iterator=counted())
        return count

    def sampler_param_checksum(self) -> float:
        model = self.model_runner.get_model()
        return float(sum(p.detach().double().sum().item() for p in model.parameters()))
