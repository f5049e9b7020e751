"""Catch-up from a peer: the copy of the weights a replica keeps after a push over the network, streamed to
another replica over HTTP, verified by the receiver before anything is written.

Why: weights pushed over the network have no durable copy. A replica created, restarted or replaced after
the push gets them from a ready peer that serves the label (docs/design/weights-over-network.md, phase D):
the operator names the peers in the replica's load (`{"sha256", "peers": [url, ...]}`).

The wire is one safetensors file, the simplest thing both sides and every tool already read:
`GET /v1/weights/staged?sha256=<digest>` (admin key, on the replica's own port, so a NetworkPolicy opens
one port) answers 8 bytes of header length, the header (the tensors in checkpoint naming, `__metadata__`
naming the model digest, label and step), then the tensors' bytes end to end. `curl ... -o
model.safetensors` is a checkpoint of the pushed weights. The serving side reads its kept copy from the
engine in slices (`stream_kept`); the receiving side (`CopyReader`, `fetch`) checks the header against the
served model's schema (names, dtypes, shapes: what a checkpoint load checks) and the digest asked for,
hashes every tensor as its bytes arrive, and only when the model digest of what arrived equals the digest
asked for is the copy handed to the write. A peer whose copy fails any check is skipped for the next.
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sampler_common.errors import SamplerError
from sampler_common.weight_transfer.digest import TensorRecord, model_sha256

from ..engine.base import Engine, KeptWeights, StagedCheckpoint, TensorMeta
from .safetensors_header import MAX_HEADER_BYTES, METADATA_KEY, SafetensorsHeaderError, parse_header
from .validation import SAFETENSORS_TO_TORCH, TORCH_DTYPES, CheckpointInvalid, TensorSpec, validate_tensor_metadata

log = logging.getLogger(__name__)

PATH = "/v1/weights/staged"
MEDIA_TYPE = "application/octet-stream"
# The kept copy is read from the engine, and a peer's written into it, in slices of this size: each is
# one call between engine steps, so sampling goes on while a copy moves.
SLICE_BYTES = 8 << 20
# Between two reads of a peer's stream: a peer that goes silent this long is skipped.
READ_TIMEOUT_S = 60.0


class PeerCopyFailed(Exception):
    """A peer's copy could not be had, or failed a check: nothing of it was written. The next peer is tried."""


class WeightsUnavailable(SamplerError):
    """A load named weights by their digest, and neither this replica (a push received, its kept copy), nor
    a peer, nor a checkpoint has them: nothing was written, the replica stays as it is."""

    status_code = 409
    category = "weights_unavailable"


# ---------------------------------------------------------------------------- serving


def header_bytes(kept: KeptWeights, label: str | None, step: int | None) -> bytes:
    """The safetensors header of the kept copy: its tensors in `kept`'s order, end to end."""
    meta = {"format": "pt", "sha256": kept.sha256}
    if label is not None:
        meta["label"] = label
    if step is not None:
        meta["step"] = str(step)
    doc: dict[str, Any] = {METADATA_KEY: meta}
    offset = 0
    for t in kept.tensors:
        doc[t.name] = {"dtype": TORCH_DTYPES[t.dtype], "shape": list(t.shape),
                       "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(doc, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(raw)) + raw


def stream_length(kept: KeptWeights, label: str | None, step: int | None) -> int:
    return len(header_bytes(kept, label, step)) + kept.total_bytes


async def stream_kept(engine: Engine, kept: KeptWeights, label: str | None, step: int | None) -> AsyncIterator[bytes]:
    """The kept copy as a safetensors stream. If the copy is dropped meanwhile (another push was kept), the
    stream stops short: the receiver sees it truncated and writes nothing of it."""
    yield header_bytes(kept, label, step)
    total = kept.total_bytes
    for offset in range(0, total, SLICE_BYTES):
        yield await engine.read_kept(kept.sha256, offset, min(SLICE_BYTES, total - offset))


# ---------------------------------------------------------------------------- receiving


@dataclass
class _Tensor:
    meta: TensorMeta
    start: int  # in the data section


class CopyReader:
    """A peer's stream, fed as it arrives (pure): the header checked first (the digest it names is the one
    asked for; its tensors are the served model's, as a checkpoint's are checked), then the data section,
    each tensor hashed as its bytes pass. `feed` returns what to write, as (data offset, bytes); `finish`
    checks that everything arrived and that its model digest is the one asked for."""

    def __init__(self, sha256: str, schema: Mapping[str, TensorSpec]) -> None:
        self.sha256 = sha256.lower()
        self.schema = schema
        self._buf = bytearray()
        self._header_len: int | None = None
        self.tensors: list[TensorMeta] | None = None
        self._layout: list[_Tensor] = []
        self._total = 0
        self._at = 0  # data bytes received
        self._index = 0
        self._hash = hashlib.sha256()
        self._digests: list[str] = []
        self.label: str | None = None

    @property
    def total_bytes(self) -> int:
        return self._total

    @property
    def received(self) -> int:
        return self._at

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        if self.tensors is None:
            self._buf += data
            if not self._read_header():
                return []
            data, self._buf = bytes(self._buf), bytearray()
        return self._data(data)

    def _read_header(self) -> bool:
        if self._header_len is None:
            if len(self._buf) < 8:
                return False
            (n,) = struct.unpack("<Q", self._buf[:8])
            if n > MAX_HEADER_BYTES:
                raise PeerCopyFailed(f"its header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit")
            self._header_len = n
        if len(self._buf) < 8 + self._header_len:
            return False
        raw = bytes(self._buf[8:8 + self._header_len])
        del self._buf[:8 + self._header_len]
        self._parse(raw)
        return True

    def _parse(self, raw: bytes) -> None:
        try:
            doc = json.loads(raw)
            sizes = [e["data_offsets"][1] for k, e in doc.items() if k != METADATA_KEY]
            entries, meta = parse_header(raw, max(sizes, default=0))
        except (ValueError, KeyError, TypeError, IndexError) as e:
            raise PeerCopyFailed(f"its header is not a safetensors header: {e}") from None
        except SafetensorsHeaderError as e:
            raise PeerCopyFailed(f"its header is not a safetensors header: {e.message}") from None
        offered = meta.get("sha256", "").lower()
        if offered != self.sha256:
            raise PeerCopyFailed(f"it offers sha256 {offered or 'none'}, not {self.sha256}")
        metas = []
        for entry in entries:
            dtype = SAFETENSORS_TO_TORCH.get(entry.dtype)
            if dtype is None:
                raise PeerCopyFailed(f"tensor {entry.name!r} has dtype {entry.dtype}, which the model digest cannot "
                                     "name")
            metas.append(TensorMeta(entry.name, dtype, entry.shape, entry.nbytes))
        try:
            validate_tensor_metadata([m.name for m in metas], [m.dtype for m in metas], [list(m.shape) for m in metas],
                                     self.schema, field="peers")
        except CheckpointInvalid as ci:
            raise PeerCopyFailed(f"its copy does not fit the served model: {ci.message}") from None
        self.tensors = metas
        start = 0
        for m in metas:
            self._layout.append(_Tensor(m, start))
            start += m.nbytes
        self._total = start
        self.label = meta.get("label")
        self._skip_empty()

    def _skip_empty(self) -> None:
        # Tensors of no bytes are complete as soon as they are reached.
        while self._index < len(self._layout) and self._layout[self._index].meta.nbytes == 0:
            self._close()

    def _close(self) -> None:
        self._digests.append(self._hash.hexdigest())
        self._hash = hashlib.sha256()
        self._index += 1

    def _data(self, data: bytes) -> list[tuple[int, bytes]]:
        if not data:
            return []
        if self._at + len(data) > self._total:
            raise PeerCopyFailed(f"it sent more than the {self._total} bytes its header announced")
        out = [(self._at, data)]
        view = memoryview(data)
        while view:
            t = self._layout[self._index]
            take = min(len(view), t.start + t.meta.nbytes - self._at)
            self._hash.update(view[:take])
            view = view[take:]
            self._at += take
            if self._at == t.start + t.meta.nbytes:
                self._close()
                self._skip_empty()
        return out

    def finish(self) -> None:
        if self.tensors is None:
            raise PeerCopyFailed("its stream ended before its header")
        if self._at != self._total:
            raise PeerCopyFailed(f"its stream ended after {self._at} of {self._total} bytes")
        got = model_sha256(TensorRecord(t.meta.name, t.meta.dtype, t.meta.shape, d)
                           for t, d in zip(self._layout, self._digests, strict=True))
        if got != self.sha256:
            raise PeerCopyFailed(f"the model digest of what it sent is {got}, not {self.sha256}")


def batched(pieces: Sequence[tuple[int, bytes]], pending: tuple[int, bytearray] | None,
            size: int = SLICE_BYTES) -> tuple[list[tuple[int, bytes]], tuple[int, bytearray] | None]:
    """Contiguous pieces gathered into slices of `size` (pure): what is ready to write, and what waits."""
    ready: list[tuple[int, bytes]] = []
    for offset, data in pieces:
        if pending is None:
            pending = (offset, bytearray())
        pending[1].extend(data)
        if len(pending[1]) >= size:
            ready.append((pending[0], bytes(pending[1])))
            pending = None
    return ready, pending


@dataclass(frozen=True)
class Fetched:
    staged: StagedCheckpoint
    peer: str
    total_bytes: int
    seconds: float


async def fetch(engine: Engine, peer: str, sha256: str, schema: Mapping[str, TensorSpec], api_key: str | None,
                keep: bool, deadline: float) -> Fetched:
    """One peer's copy of the weights of `sha256`, verified, staged in the engine (kept once written when
    `keep`). Raises `PeerCopyFailed` naming why, with nothing staged."""
    import aiohttp

    left = deadline - time.monotonic()
    if left <= 0:
        raise PeerCopyFailed("no time left within the load's timeout_s")
    headers = {"X-API-Key": api_key} if api_key else {}
    timeout = aiohttp.ClientTimeout(total=left, sock_connect=min(left, 10.0), sock_read=READ_TIMEOUT_S)
    reader = CopyReader(sha256, schema)
    staged: StagedCheckpoint | None = None
    t0 = time.monotonic()
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session, \
                session.get(peer.rstrip("/") + PATH, params={"sha256": sha256}, headers=headers) as r:
            if r.status != 200:
                body = (await r.read())[:500]
                raise PeerCopyFailed(f"it answered {r.status}: {_message(body)}")
            pending: tuple[int, bytearray] | None = None
            async for data in r.content.iter_chunked(1 << 20):
                pieces = reader.feed(data)
                if staged is None and reader.tensors is not None:
                    staged = await engine.stage_incoming(reader.tensors)
                ready, pending = batched(pieces, pending)
                for offset, piece in ready:
                    assert staged is not None
                    await engine.write_incoming(staged, offset, piece)
            reader.finish()
            if staged is None:  # a model of no bytes at all: the header alone
                assert reader.tensors is not None
                staged = await engine.stage_incoming(reader.tensors)
            if pending is not None:
                await engine.write_incoming(staged, pending[0], bytes(pending[1]))
            sealed = await engine.seal_incoming(staged, sha256 if keep else None)
    except PeerCopyFailed:
        if staged is not None:
            await engine.discard_staged(staged)
        raise
    except (aiohttp.ClientError, OSError, TimeoutError, UnicodeError) as e:  # UnicodeError: a name IDNA refuses
        if staged is not None:
            await engine.discard_staged(staged)
        raise PeerCopyFailed(f"{type(e).__name__}: {e}"[:300]) from None
    except BaseException:
        if staged is not None:
            await engine.discard_staged(staged)
        raise
    return Fetched(sealed, peer, reader.total_bytes, time.monotonic() - t0)


def _message(body: bytes) -> str:
    try:
        err = json.loads(body).get("error") or {}
        return str(err.get("message") or body.decode(errors="replace"))
    except (ValueError, AttributeError):
        return body.decode(errors="replace")
