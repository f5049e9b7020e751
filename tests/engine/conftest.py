"""Real-engine tier: one shared vLLM server for the read-only tests (startup is ~15 s)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.server import RunningServer, run_server


@pytest.fixture(scope="session")
def shared_server(tiny_model: Path) -> Iterator[RunningServer]:
    # Test seams on: the concurrency tests freeze the engine (tests.support.server.engine_paused).
    with run_server(tiny_model, "--concurrent-task-limit", "128", "--enable-test-seams") as s:
        yield s


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/engine/" in str(item.fspath):
            item.add_marker(pytest.mark.engine)
