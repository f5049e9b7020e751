"""The chain: how a push's bytes travel from the trainer through every receiving worker, and how a tear
reaches every rank at once.

Why a chain. gloo's broadcast has its root send every byte to each receiver in turn, so a push to N
replicas costs the trainer N copies (4.7x the time to one replica, for two, on a 2-core box). Here the
ranks pass the bytes on in rank order instead, as NCCL's ring and checkpoint-engine's P2P mode do: the
trainer (rank 0) sends each chunk once, to rank 1; rank k receives chunk i from rank k-1 and forwards it
to rank k+1 while chunk i+1 arrives and while its worker hashes chunk i. Every hop is point-to-point
(gloo send/recv) with at most `WINDOW` chunks in flight, so a push to N receivers takes the time of one
plus a chunk per extra hop. The ranks a pool gives its replicas (replica k's workers from 1 + the workers
of the replicas before it) make the chain run through every worker of every replica; the last one
forwards nothing.

The wire. Both ends cut the push into the same chunks (chunks.py): chunk i travels under tag i, and a
chunk of 0 bytes does not travel at all. After the last chunk the trailer (every tensor's digest, the
trainer's) travels the same way under tag `len(chunks)`, so every rank checks what it received against
the trainer's own digests; a rank that forwarded bytes other than those it was sent fails the next
rank's check as well as its own.

A tear reaches every rank at once. A rank that dies closes its connections, and gloo fails the
operations still waiting their turn on them, but not the receive that was reading at that moment
(gloo/transport/tcp/pair.cc no longer lists its buffer): that one would wait out its whole timeout. So
a receiver posts the trailer's receive first, and a watcher thread waits on it: the trailer waits its
turn on the connection to the previous rank for the whole push, so a dead previous rank fails it at
once and the watcher reports the tear (`torn`). Whoever sees a failure first closes every connection of
its group (`close_connections`): its neighbours' operations fail at once in turn, and so on along the
chain, both ways. A rank that hangs fails its neighbours' waits after the group's timeout, and gloo
then closes every connection of theirs: the same cascade, one timeout later.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed import ProcessGroupGloo

# Chunks in flight on each hop: one on the wire while the next is packed (trainer) or posted (receivers).
WINDOW = 2
# A tag no chunk takes (gloo's tags are 32-bit): `close_connections` waits for a message under it that
# nobody sends.
_CLOSE_TAG = (1 << 31) - 1
_CLOSE_WAIT = datetime.timedelta(milliseconds=1)


@dataclass(frozen=True)
class Hop:
    """One rank's place in the chain: it receives from `rank - 1` and forwards to `rank + 1`, if any."""

    group: ProcessGroupGloo
    rank: int
    world_size: int

    @property
    def previous(self) -> int:
        return self.rank - 1

    @property
    def next(self) -> int | None:
        return self.rank + 1 if self.rank + 1 < self.world_size else None


def close_connections(hop: Hop) -> None:
    """Close every connection of the group now, so that each peer's operations on them fail now rather
    than at their timeout. gloo closes all of a group's connections when one of its waits times out
    (dropping the group would close them too, but an operation still waiting holds it): so wait 1 ms for
    a message nobody sends. A connection already closed refuses the receive at once; the next is tried."""
    for peer in range(hop.world_size):
        if peer != hop.rank:
            with contextlib.suppress(Exception):  # timed out (all closed), or this one was closed already
                hop.group.recv([torch.empty(1, dtype=torch.uint8)], peer, _CLOSE_TAG).wait(_CLOSE_WAIT)


def waiting(work: Any | None, timeout: datetime.timedelta | None = None) -> concurrent.futures.Future[None]:
    """A future of a gloo send's or receive's completion (those works have none of their own): a daemon
    thread waits on it (`timeout`, or the group's). None (a chunk of 0 bytes) is done already."""
    done: concurrent.futures.Future[None] = concurrent.futures.Future()
    if work is None:
        done.set_result(None)
        return done

    def wait() -> None:
        try:
            work.wait() if timeout is None else work.wait(timeout)
            done.set_result(None)
        except BaseException as e:  # handed to whoever waits on the future
            done.set_exception(e)

    threading.Thread(target=wait, name="weight-transfer-wait", daemon=True).start()
    return done


def send(hop: Hop, chunk: torch.Tensor, tag: int) -> concurrent.futures.Future[None]:
    """Send `chunk` to the next rank under `tag` (nothing for 0 bytes). The chunk must live until it is sent."""
    assert hop.next is not None
    return waiting(hop.group.send([chunk], hop.next, tag) if chunk.numel() else None)


def receive(hop: Hop, buffers: list[torch.Tensor], trailer: torch.Tensor, timeout: datetime.timedelta,
            landed: Callable[[torch.Tensor], None], torn: Callable[[BaseException], None]) -> list[torch.Tensor]:
    """This rank's part of one push: every chunk from the previous rank into `buffers` (uint8, one per
    chunk, of its size: the caller's, so that it may keep them from push to push), each forwarded to the
    next rank, if any, while the next one arrives; then the trailer into `trailer`, forwarded too.
    `landed(chunk)` runs on each chunk in order as it lands (the worker hashes it there while the next
    one travels). Returns the chunks; raises when the push tears.

    `torn(error)` is called once, at the first failure the watcher sees (`timeout` bounds its wait on the
    trailer: the whole push), possibly while this thread still waits on a receive gloo will only fail at
    its own timeout; the caller reports the tear from there, and this call raises later."""
    received: list[torch.Tensor] = []
    tear = _Tear(hop, torn, received)
    watcher = waiting(hop.group.recv([trailer], hop.previous, len(buffers)), timeout)
    watcher.add_done_callback(lambda f: tear(f.exception()))
    posted: deque[tuple[torch.Tensor, Any | None]] = deque()
    sends: deque[concurrent.futures.Future[None]] = deque()

    def forward(buf: torch.Tensor, tag: int) -> concurrent.futures.Future[None]:
        # A next rank that dies fails the send at once: the tear is reported from here, even while this
        # thread waits on a receive from a previous rank that has nothing to send yet.
        sent = send(hop, buf, tag)
        sent.add_done_callback(lambda f: tear(f.exception()))
        return sent

    def post(i: int) -> None:
        buf = buffers[i]
        posted.append((buf, hop.group.recv([buf], hop.previous, i) if buf.numel() else None))

    try:
        for i in range(min(WINDOW, len(buffers))):
            post(i)
        for i in range(len(buffers)):
            buf, work = posted.popleft()
            if work is not None:
                work.wait()
            tear.check()
            if i + WINDOW < len(buffers):
                post(i + WINDOW)
            if hop.next is not None:
                sends.append(forward(buf, i))
            received.append(buf)
            landed(buf)
            while len(sends) > WINDOW:
                sends.popleft().result()
        watcher.result()
        if hop.next is not None:
            sends.append(forward(trailer, len(buffers)))
        while sends:
            sends.popleft().result()
    except BaseException as e:
        tear(e)
        raise
    return received


class _Tear:
    """The first failure of a push on this rank: reported once (`torn`), every connection closed, and the
    chunks received so far let go (a receive gloo fails only at its timeout would hold them until then)."""

    def __init__(self, hop: Hop, torn: Callable[[BaseException], None], received: list[torch.Tensor]) -> None:
        self._hop, self._torn, self._received = hop, torn, received
        self._lock = threading.Lock()
        self.error: BaseException | None = None

    def __call__(self, error: BaseException | None) -> None:
        if error is None:
            return
        with self._lock:
            if self.error is not None:
                return
            self.error = error
        self._received.clear()
        close_connections(self._hop)
        self._torn(error)

    def check(self) -> None:
        """Raise the watcher's failure, if it saw one while this thread was waiting."""
        if self.error is not None:
            raise self.error
