"""Checkpoint and adapter routes (placeholder until implemented)."""

from __future__ import annotations

from fastapi import APIRouter

from .core import SamplerCore


def weights_router(core: SamplerCore) -> APIRouter:
    return APIRouter(prefix="/v1", tags=["weights"])
