"""The paths of vLLM's OpenAI-compatible API a replica serves (no vLLM import: the fake engine's
server answers them with a 404 that says why)."""

OPENAI_PATHS = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/inference/v1/generate",
                "/tokenize", "/detokenize")
