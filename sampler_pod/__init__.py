"""The sampler server that runs in every sampler pod: FastAPI over a vLLM AsyncLLM engine."""

__version__ = "0.1.0"
