"""Which loaded adapters are in use: requests in flight per adapter, and when each was last used (pure).

What a pool's placement reads from `/health` (docs/design/lora-pool.md, "Placement and eviction"),
and what guards an unload: `DELETE /v1/adapters/{name}` is refused while `in_flight(name)` > 0,
so no request loses its adapter under it (vLLM would otherwise reload it behind our back, or a
running request could crash the server; the issue's prime-rl note).

A request is counted from its admission to its one terminal state, whatever the route: the native
routes, futures, Tinker and Twinkle through `SamplerCore.admit` / `_end`, the OpenAI routes through
their guard (`openai/guard.py`). `begin` and the unload's check both run without an await between
the check and the change, so on the one event loop a request cannot slip in between them.

`last_used_at` is the later of the last admission and the last end of a request using the adapter
(ISO-8601 UTC, as `/health`'s other timestamps; None before the first use): a long request keeps its
adapter recent while it runs, and an idle one ages from when it went idle.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .health import utc_now_iso


@dataclass
class AdapterUse:
    now: Callable[[], str] = utc_now_iso
    _in_flight: dict[str, int] = field(default_factory=dict)
    _last_used: dict[str, str] = field(default_factory=dict)

    def begin(self, name: str) -> None:
        self._in_flight[name] = self._in_flight.get(name, 0) + 1
        self._last_used[name] = self.now()

    def end(self, name: str) -> None:
        left = self._in_flight.get(name, 0) - 1
        if left > 0:
            self._in_flight[name] = left
        else:
            self._in_flight.pop(name, None)
        self._last_used[name] = self.now()

    def in_flight(self, name: str) -> int:
        return self._in_flight.get(name, 0)

    def last_used_at(self, name: str) -> str | None:
        return self._last_used.get(name)

    def forget(self, name: str) -> None:
        """The adapter was unloaded (with nothing in flight): a later one of the same name starts unused."""
        self._last_used.pop(name, None)
