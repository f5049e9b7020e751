"""Twinkle's real client in tests: its state is process-global (base URL, key, session id) and each
init starts a heartbeat thread, so every test owns the clients it starts and stops them."""

from __future__ import annotations

from typing import Any

import pytest
import requests
import twinkle_client.manager as manager


class TwinkleClients:
    """Records every TwinkleClient created inside the block (also by code that never returns it,
    like a documented snippet) and closes them all at the end."""

    def __init__(self) -> None:
        self.created: list[Any] = []
        self._orig_init: Any = None

    def __enter__(self) -> TwinkleClients:
        orig = manager.TwinkleClient.__init__
        created = self.created

        def recording_init(client: Any, *a: Any, **kw: Any) -> None:
            created.append(client)
            orig(client, *a, **kw)

        self._orig_init = orig
        manager.TwinkleClient.__init__ = recording_init
        return self

    def init(self, **kw: Any) -> Any:
        from twinkle_client import init_twinkle_client

        return init_twinkle_client(**kw)

    def __exit__(self, *exc: object) -> None:
        manager.TwinkleClient.__init__ = self._orig_init
        for c in self.created:
            if hasattr(c, "_stop_event"):
                c.close()


def check_samples_and_bad_input(sampler: Any) -> None:
    """What Twinkle's `vLLMSampler` must see from any sampler address (a pod, or the pool's gateway):
    num_samples sequences with tokens, logprobs and a stop reason; a bad key is a 400 naming the field."""
    out = sampler.sample([{"input_ids": [1, 5, 9]}], sampling_params={"max_tokens": 4, "seed": 1, "logprobs": 1},
                         num_samples=3)
    assert len(out) == 1 and len(out[0].sequences) == 3
    assert all(len(q.tokens) == 4 and len(q.logprobs) == 4 and q.stop_reason == "length" for q in out[0].sequences)
    with pytest.raises(requests.HTTPError) as e:
        sampler.sample([{"input_ids": [1, 5, 9]}], sampling_params={"max_tokns": 4})
    assert e.value.response.status_code == 400 and "sampling_params.max_tokns" in str(e.value)
