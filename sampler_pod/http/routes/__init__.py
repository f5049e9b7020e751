"""Thin routes. The services they call live on `app.state` (set up in `http/app.py`)."""

from fastapi import Request

from ...core.sampler import SamplerCore


def core_of(request: Request) -> SamplerCore:
    core: SamplerCore = request.app.state.core
    return core
