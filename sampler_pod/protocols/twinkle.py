"""Twinkle-native routes (placeholder until implemented)."""

from __future__ import annotations

from fastapi import APIRouter

from ..core import SamplerCore


def twinkle_router(core: SamplerCore) -> APIRouter:
    return APIRouter(prefix="/twinkle", tags=["twinkle"])
