"""Shared fixtures. The tiny model is built locally (never downloaded) and cached by parameters."""

from __future__ import annotations

from pathlib import Path

import pytest

from sampler_pod.testing.tiny_model import cached_tiny_model


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return cached_tiny_model()
