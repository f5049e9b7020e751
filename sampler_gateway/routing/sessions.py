"""Sticky sessions (pure): which replica a client's session (`X-Session-ID`) was last answered by.

A multi-turn episode sends each turn with the whole conversation so far; the replica that answered
the previous turn holds its prefix in its KV cache, so sending the next turn there skips recomputing
it (verifiers measured ~40% prefix-cache hits without a session header). The rule:

- a session's first turn goes where the endpoint scorer sends any request (score.py: its prefix, else
  the least loaded eligible replica; no hashing: an idle pool spreads new sessions as it spreads
  requests, and a hot key cannot pile sessions on one replica);
- later turns go to the replica that answered the last one while it is eligible (ready, not
  draining, not seen failing, allowed by the version policy: `pool.choose(prefer=...)`) and not hot
  (score.py: loaded well past the least loaded replica; under `--picker least-loaded`, whatever its
  load);
- when it is not, the turn goes where a first turn would, and the session is bound to the replica
  that answered it: it moves once and stays on its new replica, even once the old one is back (its
  cache has the prefix now, the old one's went stale).

The table is bounded (least recently used sessions go first) and forgets a session idle longer than
its expiry: an RL run starts sessions by the million, and an episode abandoned mid-way never says so.
A forgotten session's next turn is a first turn again, which costs one prefix recompute, no error.
Each gateway keeps its own table (no shared state, as for ids): a session whose turns reach several
gateways may be answered by one replica per gateway.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class SessionTable:
    """Session id -> (replica, last turn's time). `capacity` sessions at most; `expiry_s` of idleness."""

    capacity: int
    expiry_s: float
    _entries: OrderedDict[str, tuple[str, float]] = field(default_factory=OrderedDict)

    def __len__(self) -> int:
        return len(self._entries)

    def owner(self, session: str, now: float) -> str | None:
        """The replica that answered the session's last turn, or None (a first turn, or it expired)."""
        found = self._entries.get(session)
        if found is None:
            return None
        replica, at = found
        if now - at > self.expiry_s:
            del self._entries[session]
            return None
        return replica

    def bind(self, session: str, replica: str, now: float) -> bool:
        """The session's turn was answered by `replica` at `now`; True when it moved (it was bound to
        another replica). Evicts the least recently used sessions past `capacity`, and the expired
        ones found at the old end on the way (their order is their last turn's)."""
        before = self.owner(session, now)
        self._entries[session] = (replica, now)
        self._entries.move_to_end(session)
        while self._entries:
            oldest, (_, at) = next(iter(self._entries.items()))
            if len(self._entries) <= self.capacity and now - at <= self.expiry_s:
                break
            del self._entries[oldest]
        return before is not None and before != replica
