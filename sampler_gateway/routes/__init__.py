"""Thin routes per protocol: parse only what routing needs (an id, a timeout, an affinity key),
call `forward.to_new`/`to_owner` (forwarding/), rewrite the ids that name a replica, pass the rest through.
`common.py` is what every protocol's routes share; `openai_wire.py` the little of vLLM's OpenAI wire the
OpenAI routes read."""
