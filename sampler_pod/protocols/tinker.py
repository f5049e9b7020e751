"""Tinker-compatible routes (placeholder until implemented)."""

from __future__ import annotations

from fastapi import APIRouter

from ..core import SamplerCore


def tinker_router(core: SamplerCore, api_key: str | None) -> APIRouter:
    return APIRouter(prefix="/api/v1", tags=["tinker"])
