"""vLLM's own OpenAI-compatible API on a replica: `/v1/models`, `/v1/completions`,
`/v1/chat/completions`, `/inference/v1/generate`, `/tokenize` and `/detokenize`.

The wire format is vLLM's: its routers and serving classes run unchanged (`app.py`), over the
replica's own `AsyncLLM` seen through `GuardedEngineClient` (`engine_client.py`), which runs every
generation under the replica's rules (the weights lock, abort-mode loads, the keep-mode gate and
the weights' prefix-cache salt). `guard.py` adds what vLLM's server has no notion of: the admission
limit shared with the native, Tinker and Twinkle routes, the per-request timeout, and the weights
every answer was sampled with (`calls.py`).
"""
