"""The engine vLLM's OpenAI serving layer talks to: the replica's `AsyncLLM`, with `generate` run
under the replica's rules.

vLLM's serving classes take an `EngineClient` and call `generate(prompt, params, request_id, ...)`
once per engine request. Everything else (the tokenizer, the renderer, `model_config`, the LoRA
calls of `/v1/models`) is the real `AsyncLLM`'s, reached through `__getattr__`. `generate` here:
- runs inside the weights' read side (`SamplerCore.engine_session`): a drain load waits for it, an
  abort-mode load aborts it (the answer is then a 503 `aborted`: resubmit), a request that arrives
  during a write waits behind it, and a replica that is starting or uncertain refuses it;
- goes through `VllmEngine.stream`: the keep-mode gate, and the weights' prefix-cache salt combined
  with a client's own `cache_salt`;
- records each finished choice's weights spans on the request's `OpenAICall` (`calls.py`);
- for a request vLLM resolved to a LoRA adapter (its `model`, through `LoadedAdapters` below): runs
  it only if that very adapter is still loaded, and counts the request as using it. An adapter
  removed since vLLM resolved the name is a 400 naming `model`: never sent with its stale id, which
  vLLM's worker would load again from its path behind the replica's back.
Failures become errors vLLM's handlers render with their status (`GracefulHTTPError`), in vLLM's
error shape; vLLM's own request validation errors pass through unchanged.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator, Mapping
from http import HTTPStatus
from typing import Any

from sampler_common.errors import Aborted, InvalidRequest, SamplerError

from ..core.sampler import SamplerCore
from ..engine.base import EngineDead, EngineRejected
from ..engine.vllm import VllmEngine, version_spans
from .calls import CURRENT, OpenAICall, check_logprobs, choice_index


def http_error(e: SamplerError) -> Exception:
    """`e` as vLLM's serving layer renders a failure with its own status."""
    from vllm.exceptions import GracefulHTTPError

    error: Exception = GracefulHTTPError(f"{e.category}: {e.message}", HTTPStatus(e.status_code))
    return error


class LoadedAdapters(Mapping[str, Any]):
    """vLLM's `OpenAIServingModels.lora_requests`, read live from the replica's loaded adapters
    (`SamplerCore.adapters`): a `model` naming one reaches the engine as that adapter (its name, id
    and path), `/v1/models` lists them, and any other name stays vLLM's 404 naming `model`, never the
    base model. Read-only: vLLM's own load/unload routes are not served here."""

    def __init__(self, core: SamplerCore) -> None:
        self._core = core

    def __getitem__(self, name: str) -> Any:
        from vllm.lora.request import LoRARequest

        ref = self._core.adapters[name]
        return LoRARequest(ref.name, ref.lora_id, ref.path)

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._core.adapters))

    def __len__(self) -> int:
        return len(self._core.adapters)


class GuardedEngineClient:
    def __init__(self, engine: VllmEngine, core: SamplerCore) -> None:
        self._engine = engine
        self._core = core

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine.llm, name)

    def generate(self, prompt: Any, sampling_params: Any, request_id: str, **kwargs: Any) -> AsyncIterator[Any]:
        """Checks the logprobs the request asks for here, when vLLM's serving code calls this, before it
        starts a stream: a refusal is then vLLM's 400 naming the field, never an error event in a 200 stream."""
        call = CURRENT.get()
        try:
            check_logprobs(self._core.cfg.logprobs_mode, sampling_params, self._engine.vocab_size,
                           *((call.logprobs_field, call.prompt_logprobs_field) if call is not None else ()))
        except InvalidRequest as e:
            from vllm.exceptions import VLLMValidationError

            raise VLLMValidationError(e.message, parameter=e.field) from None
        return self._generate(prompt, sampling_params, request_id, call, **kwargs)

    async def _generate(self, prompt: Any, sampling_params: Any, request_id: str, call: OpenAICall | None,
                        **kwargs: Any) -> AsyncIterator[Any]:
        deadline = call.deadline if call is not None else time.monotonic() + self._core.cfg.request_timeout_s
        lora = kwargs.get("lora_request")
        if lora is not None:
            ref = self._core.adapters.get(lora.lora_name)
            if ref is None or ref.lora_id != lora.lora_int_id:
                from vllm.exceptions import VLLMValidationError

                # vLLM's own kind of client error, so its handlers render the field (`param`).
                # "does not exist", as vLLM words an unknown model: a gateway places the request again.
                raise VLLMValidationError(f"The model `{lora.lora_name}` does not exist any more: the adapter was "
                                          "removed or replaced before the request reached the engine; loaded: "
                                          f"{sorted(self._core.adapters)}", parameter="model")
            if call is not None:
                call.use_adapter(ref.name)  # no await since the check above
        try:
            async with self._core.engine_session(request_id, deadline) as reading:
                last = None
                async for out in self._engine.stream(request_id, prompt, sampling_params, **kwargs):
                    last = out
                    if call is not None:
                        for c in out.outputs:
                            if c.finish_reason is not None:
                                spans = version_spans(c, len(c.token_ids), self._engine.version)
                                call.record(choice_index(call.path, request_id, sampling_params.n, c.index),
                                            [(s.version, s.start, s.end) for s in spans])
                    yield out
                if reading.aborted_by is not None and last is not None and any(
                        c.finish_reason == "abort" for c in last.outputs):
                    if call is not None:
                        call.aborted = True
                    raise Aborted(f"request {request_id} was aborted by {reading.aborted_by}; resubmit it "
                                  "(it will run on the new weights)")
        except SamplerError as e:
            raise http_error(e) from e
        except EngineRejected as e:
            raise (e.__cause__ or e) from None
        except EngineDead as e:
            from sampler_common.errors import EngineUnavailable

            raise http_error(EngineUnavailable(f"engine died: {e}")) from e

