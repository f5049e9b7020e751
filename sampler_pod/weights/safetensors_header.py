"""Read and check a safetensors file's header without reading its tensor data.

A safetensors file is: 8 bytes little-endian u64 N, then N bytes of UTF-8 JSON (the
header), then the data section. The header maps tensor name -> {dtype, shape,
data_offsets: [begin, end]} (offsets relative to the data section), plus an optional
``__metadata__`` str->str map.

Only the first 8 + N bytes are read, so checking a multi-GB shard costs one small read
and a stat. The checks mirror what the safetensors library enforces when it loads
(offsets contiguous from 0, covering the data section exactly, sizes matching
dtype x shape), so a file that passes here will not fail later inside the engine.

This module knows nothing about checkpoints or models; it raises ``SafetensorsHeaderError``
and the caller decides which file and request field to blame.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The safetensors spec caps the header at 100 MB; a larger length is a corrupt or
# hostile file, and refusing it avoids allocating whatever the length field claims.
MAX_HEADER_BYTES = 100_000_000

METADATA_KEY = "__metadata__"

# Element sizes in bytes. Sub-byte types (F4, F6 ...) are left out on purpose: their
# byte size is not dtype_size * numel, and no checkpoint this server loads uses them.
DTYPE_SIZES: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


class SafetensorsHeaderError(ValueError):
    """The file is not a well-formed safetensors file. ``tensor`` names the entry at fault, if any."""

    def __init__(self, message: str, tensor: str | None = None, *, truncated: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.tensor = tensor
        # The file is shorter than its header says: an interrupted copy, not a bad writer.
        self.truncated = truncated


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # offset into the data section
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class SafetensorsHeader:
    path: Path
    header_bytes: int  # N, the JSON length
    file_size: int
    tensors: tuple[TensorEntry, ...]  # in data-section order, the order a streaming loader reads
    metadata: dict[str, str]

    @property
    def data_start(self) -> int:
        return 8 + self.header_bytes

    @property
    def data_bytes(self) -> int:
        return self.file_size - self.data_start

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tensors)


def read_header(path: str | os.PathLike[str]) -> SafetensorsHeader:
    """Parse and fully check the header of ``path``. Raises SafetensorsHeaderError or OSError."""
    path = Path(path)
    with open(path, "rb") as f:
        # fstat on the open handle, so the size belongs to the file whose header we read.
        file_size = os.fstat(f.fileno()).st_size
        header_len = _read_header_length(f.read(8), file_size)
        raw = f.read(header_len)
    if len(raw) != header_len:
        raise SafetensorsHeaderError("file shrank while its header was being read")
    entries, metadata = _parse_header_json(raw)
    tensors = tuple(sorted(entries, key=lambda t: (t.begin, t.end)))
    _check_data_layout(tensors, file_size - 8 - header_len)
    return SafetensorsHeader(path, header_len, file_size, tensors, metadata)


def parse_header(raw: bytes, data_bytes: int) -> tuple[tuple[TensorEntry, ...], dict[str, str]]:
    """A header's JSON (`raw`, the N bytes after the length) checked as `read_header` checks a file's, for
    a data section of `data_bytes`: (its tensors in data-section order, its metadata). For a safetensors
    file that arrives as a stream (a peer's catch-up, weights/peer_copy.py), where no file size exists
    yet: the caller passes the size the header itself implies."""
    entries, metadata = _parse_header_json(raw)
    tensors = tuple(sorted(entries, key=lambda t: (t.begin, t.end)))
    _check_data_layout(tensors, data_bytes)
    return tensors, metadata


def _read_header_length(prefix: bytes, file_size: int) -> int:
    if len(prefix) < 8:
        raise SafetensorsHeaderError(f"file is {file_size} bytes, too short for the 8-byte header length")
    header_len: int = struct.unpack("<Q", prefix)[0]
    if header_len > MAX_HEADER_BYTES:
        raise SafetensorsHeaderError(f"header length {header_len} exceeds the {MAX_HEADER_BYTES}-byte limit")
    if 8 + header_len > file_size:
        raise SafetensorsHeaderError(
            f"header length {header_len} runs past the end of the {file_size}-byte file (truncated?)",
            truncated=True,
        )
    return header_len


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json.loads silently keeps the last duplicate; two entries with one name would let a
    # tensor be validated against one entry and loaded from the other.
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise SafetensorsHeaderError(f"header lists {key!r} twice", tensor=key)
        out[key] = value
    return out


def _parse_header_json(raw: bytes) -> tuple[list[TensorEntry], dict[str, str]]:
    try:
        doc = json.loads(raw.decode("utf-8"), object_pairs_hook=_reject_duplicate_keys)
    except SafetensorsHeaderError:
        raise
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsHeaderError(f"header is not valid UTF-8 JSON: {e}") from None
    if not isinstance(doc, dict):
        raise SafetensorsHeaderError(f"header is a JSON {type(doc).__name__}, expected an object")
    metadata = _parse_metadata(doc.pop(METADATA_KEY, None))
    return [_parse_entry(name, value) for name, value in doc.items()], metadata


def _parse_metadata(value: object) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise SafetensorsHeaderError(f"{METADATA_KEY} must be an object of strings")
    return value


def _is_int(x: object) -> bool:
    # bool is an int subclass; `true` as a dimension is corruption, not 1.
    return isinstance(x, int) and not isinstance(x, bool)


def _parse_entry(name: str, value: object) -> TensorEntry:
    def bad(why: str) -> SafetensorsHeaderError:
        return SafetensorsHeaderError(f"tensor {name!r}: {why}", tensor=name)

    if not name:
        raise bad("empty tensor name")
    if not isinstance(value, dict):
        raise bad("entry is not an object")
    dtype, shape, offsets = value.get("dtype"), value.get("shape"), value.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise bad(f"unsupported dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise bad(f"shape {shape!r} is not a list of non-negative integers")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(o) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise bad(f"data_offsets {offsets!r} are not [begin, end] with 0 <= begin <= end")
    expected = DTYPE_SIZES[dtype] * math.prod(shape)
    if offsets[1] - offsets[0] != expected:
        raise bad(
            f"data_offsets span {offsets[1] - offsets[0]} bytes but {dtype} x {shape} needs {expected}"
        )
    return TensorEntry(name, dtype, tuple(shape), offsets[0], offsets[1])


def _check_data_layout(tensors: tuple[TensorEntry, ...], data_bytes: int) -> None:
    """Tensors must tile the data section exactly: no gaps, no overlap, nothing past EOF.

    Gaps or overlaps mean two tensors share bytes or bytes belong to nobody, either of
    which points at a writer bug; a short data section is the classic interrupted copy.
    """
    cursor = 0
    for t in tensors:
        if t.end > data_bytes:
            raise SafetensorsHeaderError(
                f"tensor {t.name!r} needs data bytes [{t.begin}, {t.end}) but the data section "
                f"has only {data_bytes} bytes (file truncated)",
                tensor=t.name,
                truncated=True,
            )
        if t.begin != cursor:
            what = "overlaps the previous tensor" if t.begin < cursor else "leaves a gap before it"
            raise SafetensorsHeaderError(
                f"tensor {t.name!r} starts at data offset {t.begin}, expected {cursor}: it {what}",
                tensor=t.name,
            )
        cursor = t.end
    if cursor != data_bytes:
        raise SafetensorsHeaderError(
            f"data section is {data_bytes} bytes but the tensors cover only {cursor} (trailing bytes)"
        )
