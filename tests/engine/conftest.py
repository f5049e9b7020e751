"""Real-engine tier: one shared vLLM server for the read-only tests (startup is ~15 s), and one shared
pool (a gateway over 2 replicas) for the tests of the OpenAI API through a gateway."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.openai_pool import OpenAIPool, run_openai_pool
from tests.support.server import RunningServer, run_server


@pytest.fixture(scope="session")
def shared_server(tiny_model: Path) -> Iterator[RunningServer]:
    # Test seams on: the concurrency tests freeze the engine (tests.support.server.engine_paused).
    with run_server(tiny_model, "--concurrent-task-limit", "128", "--enable-test-seams") as s:
        yield s


class _PoolOnce:
    """The shared pool, started by its first test and stopped right after its last one (not at the
    session's end: two idle engines would sit beside every later test of the tier)."""

    def __init__(self) -> None:
        self._stack: contextlib.ExitStack | None = None
        self._pool: OpenAIPool | None = None

    def get(self, model_dir: Path) -> OpenAIPool:
        if self._pool is None:
            self._stack = contextlib.ExitStack()
            self._pool = self._stack.enter_context(run_openai_pool(model_dir))
        return self._pool

    def close(self) -> None:
        if self._stack is not None:
            stack, self._stack, self._pool = self._stack, None, None
            stack.close()


_POOL = _PoolOnce()
POOL_FIXTURE = "openai_pool"


@pytest.fixture(scope="session")
def openai_pool(tiny_model: Path) -> Iterator[OpenAIPool]:
    try:
        yield _POOL.get(tiny_model)
    finally:
        _POOL.close()


def _uses_pool(item: pytest.Item | None) -> bool:
    return item is not None and POOL_FIXTURE in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/engine/" in str(item.fspath):
            item.add_marker(pytest.mark.engine)
    # The pool's tests run one after the other (from where the first of them was), so it is up once.
    users = [i for i in items if _uses_pool(i)]
    if users:
        first = items.index(users[0])
        rest = [i for i in items if not _uses_pool(i)]
        items[:] = rest[:first] + users + rest[first:]


@pytest.hookimpl(trylast=True)  # after the test's own fixtures are torn down
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if _uses_pool(item) and not _uses_pool(nextitem):
        _POOL.close()
