"""The gateway's tests. Cases marked `both_loops` run twice: on asyncio's own event loop and on
uvloop, the loop the gateway runs on (uvicorn's choice), whose transports and sockets are not
asyncio's classes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

import pytest
import uvloop


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "both_loops: run the async test on asyncio's loop and on uvloop")


def pytest_asyncio_loop_factories(config: pytest.Config,
                                  item: pytest.Item) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    if item.get_closest_marker("both_loops") is None:
        return {"asyncio": asyncio.new_event_loop}
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
