"""The gateways of a pool share their replicas' `/health` reads: each replica is read by one of them.

Why: every gateway reads every replica's `/health` every `--refresh-interval-s` (0.5 s), so a pool of
N replicas behind G gateways answered N x G reads a half second, the replica's own work growing with
the number of gateways in front of it (issue #53: 4,096 a second at 256 replicas and 8 gateways).
Shared, each replica answers one gateway's read per interval, whatever G.

**Who reads which replica**: rendezvous hashing (highest random weight) of the replica's name over
the gateways this gateway counts as readers: itself, and each peer whose routing Lease is live, names
a peer URL (`sampler.rl.dev/peer-url`, written by routing/switch.py) and whose readings it is
receiving. Each gateway reads the replicas it owns every interval (refresh.py), and every read it
makes, owned or not, goes on its `Board`. A peer takes them with a long poll on the gateway's own port
(`GET /v1/pool/peer/readings?after=SEQ`, routes/peers.py): answered as soon as there is a read newer
than SEQ, so a read reaches every peer one loopback or pod-network round trip after it lands. Two
gateways that disagree on who reads (one Lease seen expired by one and not the other) read a replica
twice, never zero times: removing a gateway from a rendezvous set moves only its own replicas.

**A peer's reading counts as a read of this gateway's own** (`health.view_of`: one place turns an
answer into a view), under the rules its own reads follow (merge.py): only for the address it was made
at, only if nothing about the replica changed since it began (its record, or this gateway's own LoRA
loads there), and never over a read that began later (`Ledger`). When it began, by this gateway's
clock, is bounded from below without any shared clock: the peer says how old the read was when it
answered (`age_s`), and the answer came after the poll was sent, so the read began no earlier than
(poll sent) - `age_s`; that bound is what the rules use, so a read is never taken for newer than it is.

**The bound on staleness** (what LoRA placement and a load-aware picker read from a view: the age of
the `/health` answer a view shows, from when its read began). While a replica's reader is live: one
interval + one read (bounded by the interval) + one poll round trip, 1.0 s + a round trip at the
defaults, as when every gateway read everything (1.0 s). Whatever its peers do (stop, hang, partition):
a gateway that has had no read of a replica for `STALE_INTERVALS` intervals reads it itself at its next
tick, so no view is older than (`STALE_INTERVALS` + 1) intervals + two reads + a round trip: the last
read that reached it (one read + the trip), up to `STALE_INTERVALS` intervals of nothing, up to one
more to its tick, then its own read: 2.5 s at the defaults.
A membership change (a drain mark, a new pod, a status write) is read at once by every gateway that
sees it, as before: sharing changes how often a replica is read when nothing happens, not how soon a
change is.

Not shared (each gateway reads everything, as before): static discovery (no Leases), a gateway with
no address of its own for its peers (`--pod-ip` unset and a wildcard `--host`), and gateways sharing one
port on the node's network (`--reuse-port`: a connection to that port reaches any of them).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import secrets
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from ..upstream.http1 import Http1Client
from .health import HealthAnswer

log = logging.getLogger(__name__)

PATH = "/v1/pool/peer/readings"
# A long poll answers empty after this long with nothing new (a pool with no replica). Short: a
# gateway stopping waits for the polls it is answering (uvicorn's graceful shutdown) before it exits.
WAIT_S = 2.0
# After a failed poll, wait this long before the next (and the peer reads nothing meanwhile).
RETRY_S = 1.0
# A replica with no read (its own or a peer's) for this many intervals is read by this gateway.
STALE_INTERVALS = 2.0


def score(replica: str, gateway: str) -> int:
    """Highest-random-weight hashing: each (replica, gateway) pair's stable pseudo-random weight."""
    digest = hashlib.blake2b(f"{replica}\x00{gateway}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def owner(replica: str, readers: Iterable[str]) -> str:
    """Pure: the gateway that reads `replica`, among `readers` (never empty: a gateway counts itself)."""
    return max(readers, key=lambda g: (score(replica, g), g))


@dataclass(frozen=True)
class Reading:
    """One `/health` read: of which replica, at which address, its outcome, and when it began (this
    process's monotonic clock; for a peer's, the earliest it can have begun)."""

    replica: str
    url: str
    answer: HealthAnswer
    started: float


def reading_json(r: Reading, now: float) -> dict[str, Any]:
    out: dict[str, Any] = {"replica": r.replica, "url": r.url, "age_s": round(max(0.0, now - r.started), 6)}
    if r.answer.error is not None:
        out["error"], out["timed_out"] = r.answer.error, r.answer.timed_out
    else:
        out["body"] = r.answer.body
    return out


def reading_of(doc: Any, sent: float) -> Reading | None:
    """A peer's reading, `sent`: when the poll that brought it was sent (None: not well formed)."""
    if not isinstance(doc, dict):
        return None
    replica, url, age = doc.get("replica"), doc.get("url"), doc.get("age_s")
    if not isinstance(replica, str) or not isinstance(url, str) or not isinstance(age, int | float) or age < 0:
        return None
    error = doc.get("error")
    answer = (HealthAnswer(error=error, timed_out=doc.get("timed_out") is True) if isinstance(error, str)
              else HealthAnswer(body=doc.get("body")))
    return Reading(replica, url, answer, sent - float(age))


class Board:
    """The reads this gateway made, the newest per replica, for its peers to take (a long poll). A
    sequence number orders them; `epoch` names this process, so a peer polling a restarted gateway
    starts over instead of waiting for a sequence number it will not see again."""

    def __init__(self, me: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.me, self.clock = me, clock
        self.epoch = secrets.token_hex(8)
        self.seq = 0
        self._latest: dict[str, tuple[int, Reading]] = {}
        self._posted: asyncio.Event | None = None

    def post(self, reading: Reading) -> None:
        self.seq += 1
        self._latest[reading.replica] = (self.seq, reading)
        if self._posted is not None:
            self._posted.set()
            self._posted = None

    def keep(self, replicas: Iterable[str]) -> None:
        """Forget replicas no longer in the pool."""
        keep = set(replicas)
        for name in [n for n in self._latest if n not in keep]:
            del self._latest[name]

    def answer(self, after: int, epoch: str | None) -> dict[str, Any]:
        """The readings newer than `after` (all of them for another `epoch`), as the route answers them."""
        if epoch != self.epoch:
            after = 0
        now = self.clock()
        return {"gateway": self.me, "epoch": self.epoch, "seq": self.seq,
                "readings": [reading_json(r, now) for seq, r in self._latest.values() if seq > after]}

    async def wait(self, after: int, epoch: str | None, wait_s: float) -> dict[str, Any]:
        """`answer`, at once when there is something newer than `after`, else at the next post or after `wait_s`."""
        if epoch == self.epoch and self.seq <= after:
            if self._posted is None:
                self._posted = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._posted.wait(), wait_s)
        return self.answer(after, epoch)


class Directory(Protocol):
    """Where this gateway's peers are (kube discovery: the pool's gateway Leases)."""

    def peers(self, now: float) -> Mapping[str, str]:
        """Live peers (not this gateway) that name a peer URL: name -> URL. `now`: epoch seconds."""
        ...


# Applies a peer's readings (refresh.py): the readings, and the peer's name.
Apply = Callable[[list[Reading], str], Awaitable[None]]


@dataclass
class _Peer:
    url: str
    task: asyncio.Task[None] | None = None
    hearing: bool = False   # its last poll was answered


@dataclass
class Sharing:
    """This gateway's side: who reads which replica, its polls of each peer, what it serves them."""

    me: str
    directory: Directory
    client: Http1Client
    headers: tuple[tuple[str, str], ...] = ()
    board: Board | None = None
    wait_s: float = WAIT_S
    _peers: dict[str, _Peer] = field(default_factory=dict)
    _apply: Apply | None = None

    def __post_init__(self) -> None:
        if self.board is None:
            self.board = Board(self.me)

    def readers(self) -> list[str]:
        """This gateway and the peers whose readings reach it: the rendezvous set."""
        return [self.me, *sorted(n for n, p in self._peers.items() if p.hearing)]

    def sync(self, apply: Apply) -> None:
        """Poll every live peer the directory names, and only those (called at each refresh tick)."""
        self._apply = apply
        want = {n: u for n, u in self.directory.peers(time.time()).items() if n != self.me}
        for name in [n for n, p in self._peers.items() if want.get(n) != p.url]:
            self._stop(name)
        for name, url in want.items():
            if name not in self._peers:
                peer = self._peers[name] = _Peer(url)
                peer.task = asyncio.create_task(self._poll(name, peer), name=f"peer-{name}")

    def _stop(self, name: str) -> None:
        peer = self._peers.pop(name)
        if peer.task is not None:
            peer.task.cancel()

    def close(self) -> None:
        for name in list(self._peers):
            self._stop(name)

    async def _poll(self, name: str, peer: _Peer) -> None:
        after, epoch = 0, ""
        while True:
            sent = time.monotonic()
            query = urllib.parse.urlencode({"after": after, "epoch": epoch, "wait_s": self.wait_s})
            try:
                async with asyncio.timeout(self.wait_s + 5.0):
                    r = await self.client.request(peer.url, "GET", f"{PATH}?{query}", self.headers, b"")
                doc = orjson.loads(r.body) if r.status == 200 else None
                if not isinstance(doc, dict) or not isinstance(doc.get("seq"), int):
                    raise ValueError(f"HTTP {r.status}: {r.body[:200]!r}")
            except asyncio.CancelledError:
                raise
            except Exception as e:  # unreachable, restarting, refusing: its replicas are read here meanwhile
                if peer.hearing:
                    log.warning("peer gateway %s (%s) unheard: %s; reading its replicas here", name, peer.url, e)
                peer.hearing = False
                await asyncio.sleep(RETRY_S)
                continue
            if not peer.hearing:
                log.info("peer gateway %s (%s) heard: sharing /health reads with it", name, peer.url)
            peer.hearing = True
            epoch, after = str(doc.get("epoch") or ""), int(doc["seq"])
            readings = [got for d in doc.get("readings") or [] if (got := reading_of(d, sent)) is not None]
            if readings and self._apply is not None:
                await self._apply(readings, name)
