"""Build each kind of broken checkpoint from ANY good Hugging Face safetensors checkpoint dir.

Used by the unit tests of ``sampler_pod.weights.validation`` and by the real-engine
integration tests, which send ``case.request_path`` to ``POST /v1/checkpoints/load`` on a
server started with ``--checkpoint-root <root>`` (as its FIRST root: relative request
paths resolve against the first root) and expect a 400 whose error names
``case.expected_file`` / ``case.expected_tensor`` with ``code == case.expected_code``.

    root, outside = tmp / "root", tmp / "outside"
    for kind in KINDS:
        case = build_case(kind, good_dir, root=root, outside=outside)
        ...  # load case.request_path (with case.sha256_manifest if not None)

The good directory is never modified. Copies are hard links where possible and every
mutation writes a new file and renames it over the link, so even a large model costs
little disk; a mutated shard is read into memory, which is meant for small test models.

This module deliberately reads and writes the safetensors format itself (a few lines)
instead of using the code under test, so a bug there cannot hide a bug here.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

INDEX_FILE = "model.safetensors.index.json"
SHA256SUMS_FILE = "sha256sums"

# Swapping to a dtype of the same element size keeps the header self-consistent, so
# only the schema check (not the byte-size check) can catch it.
_SAME_SIZE_DTYPE = {
    "F32": "I32", "I32": "F32", "U32": "F32",
    "BF16": "F16", "F16": "BF16", "I16": "F16", "U16": "F16",
    "F64": "I64", "I64": "F64", "U64": "F64",
    "U8": "I8", "I8": "U8", "BOOL": "U8", "F8_E4M3": "F8_E5M2", "F8_E5M2": "F8_E4M3",
}


@dataclass
class RawTensor:
    name: str
    dtype: str
    shape: list[int]
    data: bytes


@dataclass(frozen=True)
class CorruptCase:
    kind: str
    request_path: str  # what a client sends as "path"
    roots: tuple[Path, ...]  # the allowed roots the case was built for
    checkpoint_dir: Path  # where the (broken) files are on disk
    expected_code: str | None  # None: the case is valid
    expected_file: str | None  # name inside the checkpoint dir the error must name
    expected_tensor: str | None  # tensor the error must name
    sha256_manifest: dict[str, str] | None = None  # send this with the load request
    expected_field: str = "path"


# --------------------------------------------------------------------------- raw format


def read_raw(path: Path) -> tuple[dict[str, str] | None, list[RawTensor]]:
    """(metadata, tensors in data order) of one safetensors file, data included."""
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header: dict[str, Any] = json.loads(blob[8 : 8 + n])
    metadata = header.pop("__metadata__", None)
    data = blob[8 + n :]
    entries = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
    return metadata, [
        RawTensor(name, e["dtype"], list(e["shape"]), data[e["data_offsets"][0] : e["data_offsets"][1]])
        for name, e in entries
    ]


def encode_raw(tensors: list[RawTensor], metadata: dict[str, str] | None = None,
               *, header_override: dict[str, Any] | None = None) -> bytes:
    """Pack tensors contiguously, as the safetensors writer does. ``header_override`` patches entries."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": t.shape, "data_offsets": [offset, offset + len(t.data)]}
        offset += len(t.data)
    for name, patch in (header_override or {}).items():
        header[name] = {**header[name], **patch}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the reference writer pads the header to 8 bytes
    return struct.pack("<Q", len(raw)) + raw + b"".join(t.data for t in tensors)


def _replace(path: Path, content: bytes) -> None:
    # Write-then-rename: `path` may be a hard link to the good checkpoint.
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(content)
    os.replace(tmp, path)


def write_raw(path: Path, tensors: list[RawTensor], metadata: dict[str, str] | None = None,
              **kw: Any) -> None:
    _replace(path, encode_raw(tensors, metadata, **kw))


def shard_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".safetensors"))


def sha256_of(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def manifest_for(directory: Path) -> dict[str, str]:
    """sha256 of every shard (and of the index, if any), keyed by file name."""
    names = shard_files(directory) + ([INDEX_FILE] if (directory / INDEX_FILE).exists() else [])
    return {n: sha256_of(directory / n) for n in names}


def write_sha256sums(directory: Path, manifest: dict[str, str] | None = None) -> Path:
    """Write ``sha256sums`` in sha256sum(1) format (the format the validator reads)."""
    manifest = manifest if manifest is not None else manifest_for(directory)
    out = directory / SHA256SUMS_FILE
    out.write_text("".join(f"{h}  {n}\n" for n, h in sorted(manifest.items())))
    return out


# --------------------------------------------------------------------------- index


def read_index(directory: Path) -> dict[str, Any] | None:
    p = directory / INDEX_FILE
    return json.loads(p.read_text()) if p.exists() else None


def write_index(directory: Path, weight_map: dict[str, str]) -> None:
    total = sum((directory / f).stat().st_size for f in set(weight_map.values()) if (directory / f).exists())
    _replace(directory / INDEX_FILE,
             json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2).encode())


def _weight_map_from_headers(directory: Path) -> dict[str, str]:
    return {t.name: f for f in shard_files(directory) for t in read_raw(directory / f)[1]}


def ensure_index(directory: Path) -> dict[str, str]:
    """Make sure an index exists (generate it from the shards) and return its weight_map."""
    index = read_index(directory)
    if index is None:
        weight_map = _weight_map_from_headers(directory)
        write_index(directory, weight_map)
        return weight_map
    return dict(index["weight_map"])


def _update_index(directory: Path, change: dict[str, str | None]) -> None:
    """Apply tensor -> file (None deletes) to the index, if there is one."""
    index = read_index(directory)
    if index is None:
        return
    weight_map = dict(index["weight_map"])
    for name, file in change.items():
        if file is None:
            weight_map.pop(name, None)
        else:
            weight_map[name] = file
    write_index(directory, weight_map)


def reshard(src: Path, dst: Path, n_shards: int = 2, *, with_index: bool = True) -> Path:
    """Rewrite a checkpoint as ``n_shards`` HF-named shards (round-robin by tensor name)."""
    tensors = sorted((t for f in shard_files(src) for t in read_raw(src / f)[1]), key=lambda t: t.name)
    n = max(1, min(n_shards, len(tensors)))
    dst.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    for i in range(n):
        name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        part = tensors[i::n]
        write_raw(dst / name, part, {"format": "pt"})
        weight_map.update({t.name: name for t in part})
    if with_index:
        write_index(dst, weight_map)
    return dst


# --------------------------------------------------------------------------- copying


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def copy_checkpoint(good: Path, dst: Path) -> Path:
    """Copy (hard-linking) the files of ``good`` into ``dst``; symlinks are copied as their targets."""
    if dst.exists() or dst.is_symlink():
        raise FileExistsError(dst)
    shutil.copytree(good, dst, symlinks=False, copy_function=_link_or_copy)
    return dst


def _pick_shard_with_most_tensors(directory: Path) -> str:
    return max(shard_files(directory), key=lambda f: (len(read_raw(directory / f)[1]), f))


def _first_nonempty(tensors: list[RawTensor]) -> RawTensor:
    return next(t for t in sorted(tensors, key=lambda t: t.name) if t.data)


# --------------------------------------------------------------------------- the cases


def _valid(d: Path) -> tuple[str | None, str | None, str | None]:
    return None, None, None


def _valid_sharded_index(d: Path) -> tuple[str | None, str | None, str | None]:
    tmp = d.with_name(d.name + ".resharding")
    reshard(d, tmp, 2, with_index=True)
    shutil.rmtree(d)
    tmp.rename(d)
    return None, None, None


def _truncated_shard(d: Path) -> tuple[str | None, str | None, str | None]:
    file = next(f for f in reversed(shard_files(d)) if any(t.data for t in read_raw(d / f)[1]))
    _, tensors = read_raw(d / file)
    last = [t for t in tensors if t.data][-1]
    blob = (d / file).read_bytes()
    _replace(d / file, blob[: len(blob) - max(1, len(last.data) // 2)])
    return "truncated", file, last.name


def _garbage_header(d: Path) -> tuple[str | None, str | None, str | None]:
    file = shard_files(d)[0]
    blob = (d / file).read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    junk = (b"\x00not json\xff" * (n // 10 + 1))[:n]  # same length, so only the JSON parse fails
    _replace(d / file, blob[:8] + junk + blob[8 + n :])
    return "bad_header", file, None


def _wrong_shape(d: Path) -> tuple[str | None, str | None, str | None]:
    file = shard_files(d)[0]
    meta, tensors = read_raw(d / file)
    t = _first_nonempty(tensors)
    # A leading 1 keeps the element count, so the header stays self-consistent.
    write_raw(d / file, tensors, meta, header_override={t.name: {"shape": [1, *t.shape]}})
    return "shape_mismatch", file, t.name


def _wrong_dtype(d: Path) -> tuple[str | None, str | None, str | None]:
    file = shard_files(d)[0]
    meta, tensors = read_raw(d / file)
    t = next(t for t in sorted(tensors, key=lambda t: t.name) if t.dtype in _SAME_SIZE_DTYPE)
    t.dtype = _SAME_SIZE_DTYPE[t.dtype]
    write_raw(d / file, tensors, meta)
    return "dtype_mismatch", file, t.name


def _missing_tensor(d: Path) -> tuple[str | None, str | None, str | None]:
    file = _pick_shard_with_most_tensors(d)
    meta, tensors = read_raw(d / file)
    gone = sorted(tensors, key=lambda t: t.name)[-1]
    rest = [t for t in tensors if t.name != gone.name]
    if rest:
        write_raw(d / file, rest, meta)
    else:  # its shard held only this tensor: the whole shard goes
        (d / file).unlink()
    _update_index(d, {gone.name: None})
    return "missing_tensor", None, gone.name


EXTRA_TENSOR = "zz_not_in_model.weight"


def _unknown_tensor(d: Path) -> tuple[str | None, str | None, str | None]:
    file = shard_files(d)[0]
    meta, tensors = read_raw(d / file)
    write_raw(d / file, [*tensors, RawTensor(EXTRA_TENSOR, "F32", [2], b"\x00" * 8)], meta)
    _update_index(d, {EXTRA_TENSOR: file})  # so only the schema check can object
    return "unknown_tensor", file, EXTRA_TENSOR


def _duplicate_tensor(d: Path) -> tuple[str | None, str | None, str | None]:
    files = shard_files(d)
    _, src_tensors = read_raw(d / files[0])
    dup = sorted(src_tensors, key=lambda t: t.name)[0]
    if len(files) >= 2:
        target = files[-1]
        meta, tensors = read_raw(d / target)
        write_raw(d / target, [*tensors, dup], meta)
    else:
        # Named to sort after any HF shard name: the validator blames the later file.
        target = "zz-duplicate.safetensors"
        write_raw(d / target, [dup], {"format": "pt"})
    return "duplicate_tensor", target, dup.name


MISSING_SHARD = "model-99999-of-99999.safetensors"


def _index_missing_file(d: Path) -> tuple[str | None, str | None, str | None]:
    weight_map = ensure_index(d)
    victim = sorted(weight_map)[0]
    weight_map[victim] = MISSING_SHARD
    write_index(d, weight_map)
    return "not_found", MISSING_SHARD, victim


def _unindexed_tensor(d: Path) -> tuple[str | None, str | None, str | None]:
    ensure_index(d)
    file = _pick_shard_with_most_tensors(d)
    victim = sorted(t.name for t in read_raw(d / file)[1])[-1]
    _update_index(d, {victim: None})
    return "index_mismatch", file, victim


def _sha256_mismatch(d: Path) -> tuple[str | None, str | None, str | None]:
    file = next(f for f in shard_files(d) if any(t.data for t in read_raw(d / f)[1]))
    blob = bytearray((d / file).read_bytes())
    blob[-1] ^= 0xFF  # inside the last tensor's data: the header stays valid
    _replace(d / file, bytes(blob))
    return "sha256_mismatch", file, None


_CONTENT_CASES = {
    "valid": _valid,
    "valid_sharded_index": _valid_sharded_index,
    "truncated_shard": _truncated_shard,
    "garbage_header": _garbage_header,
    "wrong_shape": _wrong_shape,
    "wrong_dtype": _wrong_dtype,
    "missing_tensor": _missing_tensor,
    "unknown_tensor": _unknown_tensor,
    "duplicate_tensor": _duplicate_tensor,
    "index_missing_file": _index_missing_file,
    "unindexed_tensor": _unindexed_tensor,
}
_PATH_CASES = ("path_traversal", "absolute_outside", "escaping_symlink_dir", "escaping_symlink_file")
_SHA_CASES = ("sha256_mismatch", "sha256sums_mismatch")

KINDS: tuple[str, ...] = (*_CONTENT_CASES, *_PATH_CASES, *_SHA_CASES)
INVALID_KINDS: tuple[str, ...] = tuple(k for k in KINDS if not k.startswith("valid"))


def build_case(kind: str, good_dir: str | os.PathLike[str], *, root: str | os.PathLike[str],
               outside: str | os.PathLike[str], name: str | None = None) -> CorruptCase:
    """Build case ``kind`` as ``root/<name or kind>`` (or under ``outside`` for escapes).

    ``root`` is the allowed checkpoint root; ``outside`` must not be inside any root.
    """
    good, root_p, outside_p = Path(good_dir), Path(root), Path(outside)
    root_p.mkdir(parents=True, exist_ok=True)
    outside_p.mkdir(parents=True, exist_ok=True)
    name = name or kind
    roots = (root_p,)

    def case(request: str, d: Path, code: str | None, file: str | None, tensor: str | None,
             manifest: dict[str, str] | None = None) -> CorruptCase:
        return CorruptCase(kind, request, roots, d, code, file, tensor, manifest)

    if kind in _CONTENT_CASES:
        d = copy_checkpoint(good, root_p / name)
        return case(name, d, *_CONTENT_CASES[kind](d))
    if kind in ("path_traversal", "absolute_outside", "escaping_symlink_dir"):
        d = copy_checkpoint(good, outside_p / name)
        if kind == "path_traversal":
            return case(os.path.relpath(d, root_p), d, "path_traversal", None, None)
        if kind == "absolute_outside":
            return case(str(d.resolve()), d, "path_outside_roots", None, None)
        (root_p / name).symlink_to(d.resolve(), target_is_directory=True)
        return case(name, d, "path_outside_roots", None, None)
    if kind == "escaping_symlink_file":
        d = copy_checkpoint(good, root_p / name)
        file = shard_files(d)[0]
        target = outside_p / f"{name}-{file}"
        shutil.move(d / file, target)
        (d / file).symlink_to(target.resolve())
        return case(name, d, "path_outside_roots", file, None)
    if kind in _SHA_CASES:
        d = copy_checkpoint(good, root_p / name)
        manifest = manifest_for(d)
        _, file, _ = _sha256_mismatch(d)
        if kind == "sha256sums_mismatch":
            write_sha256sums(d, manifest)
            return case(name, d, "sha256_mismatch", file, None)
        return case(name, d, "sha256_mismatch", file, None, manifest)
    raise ValueError(f"unknown corruption kind {kind!r}; known: {', '.join(KINDS)}")
