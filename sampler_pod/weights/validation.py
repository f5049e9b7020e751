"""Validate a checkpoint or LoRA adapter directory before any byte of it reaches the engine.

Everything here is pure: it reads safetensors headers (never tensor data, except to
hash) and JSON files, and knows nothing about vLLM. A write into the engine that fails
halfway leaves the replica with ``uncertain_weights``, so every failure that can be
detected up front must be detected here, where it is a plain 400.

Public API
----------
- ``resolve_confined(path, roots)``: the realpath of ``path`` if it stays inside a root.
- ``schema_from_checkpoint_dir(path)``: the base model's tensor schema, read from its own
  safetensors headers (called once at server startup; the base dir is trusted).
- ``validate_checkpoint(path, roots, schema, ...)`` -> ``ValidatedCheckpoint``.
- ``validate_lora_adapter(path, roots, max_rank=..., ...)`` -> ``ValidatedLoraAdapter``.
- ``validate_tensor_metadata(names, dtype_names, shapes, schema)``: a push over the network (vLLM's
  weight-transfer update info) against the same schema, before a byte of it is received.
- ``CheckpointInvalid``: the only exception (besides bugs) these raise.

Rules (the contract a checkpoint must meet)
-------------------------------------------
- Paths: relative paths resolve against the FIRST root; absolute paths must lie in some
  root. Any ``..`` component is refused outright, even one that would stay inside a
  root. Symlinks are followed (realpath) and the target, of the directory and of every
  file read, must lie inside a root. No roots configured means nothing is allowed.
- Layout: a directory of ``*.safetensors`` shards, optionally with
  ``model.safetensors.index.json``. The directory must hold only the shards to load: with
  an index, every ``*.safetensors`` file in it must be named by the index and every
  tensor's shard must be the one the index names.
- Full loads only: the checkpoint must provide every tensor of the schema, with the
  schema's exact shape and dtype, each exactly once, and nothing else. (A partial update
  would leave the replica a mix of two checkpoints under one version label.)
- sha256 manifest: a ``{filename: hex}`` mapping passed by the caller, or, when none is
  passed, a ``sha256sums`` file in the directory in ``sha256sum(1)`` format
  (``<64 hex>  <filename>`` per line, ``*`` binary marker and ``#`` comments allowed).
  Filenames are plain names inside the checkpoint directory. Every listed file must exist
  and match, and every shard must be listed (an unlisted shard would be unverified).

Errors are reported phase by phase (path, headers, cross-file consistency, hashes):
within a phase all problems are collected, the first one is raised and the rest ride
along in ``.errors``, so a client sees every bad tensor at once but never a cascade of
follow-on errors from an earlier phase.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from dataclasses import field as dc_field
from pathlib import Path
from typing import Any, NamedTuple

from sampler_common.errors import SamplerError

from .safetensors_header import DTYPE_SIZES, SafetensorsHeader, SafetensorsHeaderError, TensorEntry, read_header

INDEX_FILE = "model.safetensors.index.json"
SHA256SUMS_FILE = "sha256sums"
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"

# A JSON index or adapter config bigger than this is not one; refuse before parsing it.
MAX_JSON_BYTES = 64 * 1024 * 1024
# Enough to show a client the pattern of a broken checkpoint without a megabyte response.
MAX_REPORTED_ERRORS = 50

_HEX64 = re.compile(r"[0-9a-fA-F]{64}")


# --------------------------------------------------------------------------- errors


class CheckpointInvalid(SamplerError):
    """A checkpoint or adapter that must not be loaded. Renders as a 400 ``invalid_checkpoint``.

    ``code`` is a stable machine-readable reason (see the ``CODE_*`` constants); ``file``
    is a name relative to the checkpoint directory; ``tensor`` is a tensor name. The
    message repeats both, so a client that shows only the message still sees them.
    """

    status_code = 400
    category = "invalid_checkpoint"

    def __init__(
        self,
        field: str,
        file: str | None,
        tensor: str | None,
        message: str,
        *,
        code: str = "invalid",
    ) -> None:
        super().__init__(_with_location(message, file, tensor), field=field)
        self.file = file
        self.tensor = tensor
        self.code = code
        self.errors: tuple[CheckpointInvalid, ...] = (self,)

    def to_dict(self) -> dict[str, Any]:
        out = self._own_dict()
        if len(self.errors) > 1:
            out["errors"] = [e._own_dict() for e in self.errors]
        return out

    def _own_dict(self) -> dict[str, Any]:
        return {
            "category": self.category,
            "code": self.code,
            "field": self.field,
            "file": self.file,
            "tensor": self.tensor,
            "message": self.message,
        }

    def body(self) -> dict[str, Any]:
        return {"error": self.to_dict()}


# Stable reason codes. Tests and clients match on these, never on message text.
CODE_PATH_TRAVERSAL = "path_traversal"
CODE_PATH_OUTSIDE_ROOTS = "path_outside_roots"
CODE_NOT_FOUND = "not_found"
CODE_BAD_LAYOUT = "bad_layout"
CODE_BAD_HEADER = "bad_header"
CODE_TRUNCATED = "truncated"
CODE_BAD_INDEX = "bad_index"
CODE_INDEX_MISMATCH = "index_mismatch"
CODE_DUPLICATE_TENSOR = "duplicate_tensor"
CODE_UNKNOWN_TENSOR = "unknown_tensor"
CODE_MISSING_TENSOR = "missing_tensor"
CODE_SHAPE_MISMATCH = "shape_mismatch"
CODE_DTYPE_MISMATCH = "dtype_mismatch"
CODE_BAD_MANIFEST = "bad_manifest"
CODE_SHA256_MISMATCH = "sha256_mismatch"
CODE_BAD_ADAPTER_CONFIG = "bad_adapter_config"
CODE_RANK_TOO_LARGE = "rank_too_large"
CODE_BAD_LORA_TENSOR = "bad_lora_tensor"


def _with_location(message: str, file: str | None, tensor: str | None) -> str:
    where = ", ".join(p for p in (f"file {file!r}" if file else "", f"tensor {tensor!r}" if tensor else "") if p)
    return f"{where}: {message}" if where else message


class _Collector:
    """Gathers the errors of one phase, then raises the first with all of them attached."""

    def __init__(self) -> None:
        self.items: list[CheckpointInvalid] = []

    def add(self, err: CheckpointInvalid) -> None:
        self.items.append(err)

    def raise_if_any(self) -> None:
        if self.items:
            first = self.items[0]
            first.errors = tuple(self.items[:MAX_REPORTED_ERRORS])
            raise first


# --------------------------------------------------------------------------- results


class TensorSpec(NamedTuple):
    """Shape and safetensors dtype string (``"F32"``, ``"BF16"`` ...). A plain tuple works too."""

    shape: tuple[int, ...]
    dtype: str


ModelSchema = Mapping[str, TensorSpec]


@dataclass(frozen=True)
class ShardInfo:
    file: str  # name inside the checkpoint directory
    path: Path  # realpath; load from this, not from a re-resolved request path
    tensors: tuple[str, ...]  # data-section order, the cheapest order to stream
    size_bytes: int
    mtime_ns: int
    sha256: str | None = None


@dataclass(frozen=True)
class ValidatedCheckpoint:
    path: Path  # realpath of the checkpoint directory
    shards: tuple[ShardInfo, ...]  # sorted by file name
    total_bytes: int  # sum of shard file sizes
    has_index: bool
    validation_time_s: float
    sha256: dict[str, str] | None = None  # every hashed file (shards and listed extras)

    @property
    def files(self) -> list[tuple[str, list[str]]]:
        return [(s.file, list(s.tensors)) for s in self.shards]

    @property
    def tensor_count(self) -> int:
        return sum(len(s.tensors) for s in self.shards)

    def assert_unchanged(self, field: str = "path") -> None:
        """Re-stat every shard; raise if one changed since validation.

        Cheap insurance for the loader to call right before streaming: it narrows the
        window in which a shard rewritten after validation would go in unchecked.
        """
        for s in self.shards:
            try:
                st = os.stat(s.path)
            except OSError as e:
                raise CheckpointInvalid(field, s.file, None, f"vanished after validation: {e.strerror}",
                                        code=CODE_NOT_FOUND) from None
            if (st.st_size, st.st_mtime_ns) != (s.size_bytes, s.mtime_ns):
                raise CheckpointInvalid(field, s.file, None, "changed on disk after validation",
                                        code=CODE_BAD_LAYOUT)

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "files": [{"file": f, "tensors": t} for f, t in self.files],
            "total_bytes": self.total_bytes,
            "tensor_count": self.tensor_count,
            "has_index": self.has_index,
            "sha256": self.sha256,
            "validation_time_s": self.validation_time_s,
        }


@dataclass(frozen=True)
class LoraModule:
    name: str  # module path with PEFT's "base_model.model." prefix removed
    rank: int
    in_features: int
    out_features: int


@dataclass(frozen=True)
class ValidatedLoraAdapter:
    path: Path
    rank: int  # the config's r
    max_module_rank: int  # the largest rank in use, after rank_pattern
    lora_alpha: float
    target_modules: list[str] | str
    modules: tuple[LoraModule, ...]
    weights: ShardInfo
    config: dict[str, Any] = dc_field(repr=False)
    validation_time_s: float = 0.0
    sha256: dict[str, str] | None = None

    @property
    def total_bytes(self) -> int:
        return self.weights.size_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "rank": self.rank,
            "max_module_rank": self.max_module_rank,
            "lora_alpha": self.lora_alpha,
            "target_modules": self.target_modules,
            "modules": [m.name for m in self.modules],
            "total_bytes": self.total_bytes,
            "sha256": self.sha256,
            "validation_time_s": self.validation_time_s,
        }


# --------------------------------------------------------------------------- paths


def resolve_confined(path: str, roots: Sequence[str | os.PathLike[str]], *, field: str = "path") -> Path:
    """Return the realpath of ``path`` if it lies inside one of ``roots``; else raise.

    The realpath (not the lexical path) is what is checked and returned, so a symlink
    anywhere on the way cannot lead outside the roots.
    """

    def refuse(code: str, why: str) -> CheckpointInvalid:
        return CheckpointInvalid(field, None, None, f"path {path!r} {why}", code=code)

    if not isinstance(path, str) or not path or "\x00" in path:
        raise refuse(CODE_BAD_LAYOUT, "is empty or not a valid path string")
    # Refused lexically, before resolving: ".." has no legitimate use in a request, and
    # refusing it keeps path-guessing probes from learning what exists outside a root.
    if ".." in Path(path).parts or ".." in path.replace("\\", "/").split("/"):
        raise refuse(CODE_PATH_TRAVERSAL, "contains '..'")
    real_roots = [Path(os.path.realpath(r)) for r in roots]
    if not real_roots:
        raise refuse(CODE_PATH_OUTSIDE_ROOTS, "cannot be loaded: no checkpoint roots are configured")
    candidate = Path(path) if os.path.isabs(path) else Path(roots[0]) / path
    real = Path(os.path.realpath(candidate))
    if not _inside_any(real, real_roots):
        raise refuse(CODE_PATH_OUTSIDE_ROOTS, "resolves outside the allowed checkpoint roots")
    return real


def _inside_any(real: Path, real_roots: Iterable[Path]) -> bool:
    return any(real == r or real.is_relative_to(r) for r in real_roots)


def _real_roots(roots: Sequence[str | os.PathLike[str]] | None) -> list[Path] | None:
    return None if roots is None else [Path(os.path.realpath(r)) for r in roots]


def _confined_file(directory: Path, name: str, real_roots: list[Path] | None, field: str) -> Path:
    """A file in the checkpoint dir, resolved; a symlinked shard must not escape either."""
    real = Path(os.path.realpath(directory / name))
    if real_roots is not None and not _inside_any(real, real_roots):
        raise CheckpointInvalid(field, name, None, "is a symlink that resolves outside the allowed roots",
                                code=CODE_PATH_OUTSIDE_ROOTS)
    return real


def _is_plain_name(name: object) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name


# --------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class _Layout:
    directory: Path
    shard_files: tuple[str, ...]  # sorted
    weight_map: dict[str, str] | None  # tensor -> file, from the index


def _require_dir(real: Path, field: str) -> None:
    if not real.exists():
        raise CheckpointInvalid(field, None, None, "checkpoint directory does not exist", code=CODE_NOT_FOUND)
    if not real.is_dir():
        raise CheckpointInvalid(field, None, None, "checkpoint path is not a directory", code=CODE_BAD_LAYOUT)


def _read_json_file(path: Path, name: str, field: str, code: str) -> Any:
    try:
        size = path.stat().st_size
        if size > MAX_JSON_BYTES:
            raise CheckpointInvalid(field, name, None, f"is {size} bytes, too large for a JSON file", code=code)
        return json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointInvalid(field, name, None, f"cannot be read as JSON: {e}", code=code) from None


def _read_weight_map(directory: Path, real_roots: list[Path] | None, field: str) -> dict[str, str] | None:
    # lexists: a dangling index symlink is a broken checkpoint, not an unindexed one.
    if not os.path.lexists(directory / INDEX_FILE):
        return None
    doc = _read_json_file(_confined_file(directory, INDEX_FILE, real_roots, field), INDEX_FILE, field,
                          CODE_BAD_INDEX)
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointInvalid(field, INDEX_FILE, None, "has no non-empty 'weight_map' object", code=CODE_BAD_INDEX)
    for tensor, file in weight_map.items():
        if not _is_plain_name(file) or not file.endswith(".safetensors"):
            raise CheckpointInvalid(field, INDEX_FILE, tensor,
                                    f"maps to {file!r}, not a .safetensors file in the checkpoint directory",
                                    code=CODE_BAD_INDEX)
    return weight_map


def _discover(directory: Path, real_roots: list[Path] | None, field: str) -> _Layout:
    on_disk = {p.name for p in directory.iterdir() if p.name.endswith(".safetensors")}
    weight_map = _read_weight_map(directory, real_roots, field)
    if weight_map is not None:
        # Report the first tensor per missing file: "which weights are gone" is what a
        # user needs to find the failed upload.
        first_tensor: dict[str, str] = {}
        for tensor, file in weight_map.items():
            first_tensor.setdefault(file, tensor)
        errors = _Collector()
        for file in sorted(set(first_tensor) - on_disk):
            errors.add(CheckpointInvalid(field, file, first_tensor[file],
                                         f"is named by {INDEX_FILE} but does not exist", code=CODE_NOT_FOUND))
        errors.raise_if_any()
    if not on_disk:
        raise CheckpointInvalid(field, None, None, "directory contains no *.safetensors files",
                                code=CODE_BAD_LAYOUT)
    return _Layout(directory, tuple(sorted(on_disk)), weight_map)


# --------------------------------------------------------------------------- headers


def _read_headers(layout: _Layout, real_roots: list[Path] | None, field: str) -> dict[str, SafetensorsHeader]:
    errors = _Collector()
    headers: dict[str, SafetensorsHeader] = {}
    for name in layout.shard_files:
        try:
            real = _confined_file(layout.directory, name, real_roots, field)
            if not real.is_file():
                raise CheckpointInvalid(field, name, None, "is not a regular file", code=CODE_BAD_LAYOUT)
            headers[name] = read_header(real)
        except CheckpointInvalid as e:
            errors.add(e)
        except SafetensorsHeaderError as e:
            code = CODE_TRUNCATED if e.truncated else CODE_BAD_HEADER
            errors.add(CheckpointInvalid(field, name, e.tensor, e.message, code=code))
        except OSError as e:
            errors.add(CheckpointInvalid(field, name, None, f"cannot be read: {e.strerror}", code=CODE_NOT_FOUND))
    errors.raise_if_any()
    return headers


# --------------------------------------------------------------------------- consistency


def _tensor_locations(headers: Mapping[str, SafetensorsHeader], errors: _Collector, field: str) -> dict[str, str]:
    """tensor -> the file holding it; a tensor in two files is reported, not silently picked."""
    where: dict[str, str] = {}
    for file in sorted(headers):
        for name in headers[file].names:
            if name in where:
                errors.add(CheckpointInvalid(field, file, name, f"also present in {where[name]!r}",
                                             code=CODE_DUPLICATE_TENSOR))
            else:
                where[name] = file
    return where


def _check_index(weight_map: Mapping[str, str], headers: Mapping[str, SafetensorsHeader],
                 errors: _Collector, field: str) -> None:
    actual = {(file, name) for file, h in headers.items() for name in h.names}
    indexed = {(file, name) for name, file in weight_map.items()}
    # A shard the index never mentions is a leftover from another checkpoint, or the index is stale.
    for file in sorted(set(headers) - set(weight_map.values())):
        errors.add(CheckpointInvalid(field, file, None, f"is not named by {INDEX_FILE}", code=CODE_INDEX_MISMATCH))
    for file, name in sorted(indexed - actual):
        errors.add(CheckpointInvalid(field, file, name, f"{INDEX_FILE} places this tensor here but the file lacks it",
                                     code=CODE_INDEX_MISMATCH))
    for file, name in sorted(actual - indexed):
        where = weight_map.get(name)
        why = f"{INDEX_FILE} places it in {where!r}" if where else f"it is not in {INDEX_FILE}"
        errors.add(CheckpointInvalid(field, file, name, f"file holds this tensor but {why}",
                                     code=CODE_INDEX_MISMATCH))


def _check_schema(headers: Mapping[str, SafetensorsHeader], where: Mapping[str, str],
                  schema: Mapping[str, tuple[tuple[int, ...], str]], errors: _Collector, field: str) -> None:
    for file in sorted(headers):
        for t in headers[file].tensors:
            spec = schema.get(t.name)
            if spec is None:
                errors.add(CheckpointInvalid(field, file, t.name, "is not a tensor of the served model",
                                             code=CODE_UNKNOWN_TENSOR))
                continue
            shape, dtype = tuple(spec[0]), str(spec[1])
            if t.shape != shape:
                errors.add(CheckpointInvalid(field, file, t.name, f"has shape {list(t.shape)}, model expects "
                                             f"{list(shape)}", code=CODE_SHAPE_MISMATCH))
            if t.dtype != dtype:
                errors.add(CheckpointInvalid(field, file, t.name, f"has dtype {t.dtype}, model expects {dtype}",
                                             code=CODE_DTYPE_MISMATCH))
    for name in sorted(set(schema) - set(where)):
        errors.add(CheckpointInvalid(field, None, name, "is missing: a checkpoint load must provide every "
                                     "tensor of the model", code=CODE_MISSING_TENSOR))


# --------------------------------------------------------------------------- sha256


def parse_sha256sums(text: str) -> dict[str, str]:
    """Parse ``sha256sum(1)`` output: ``<hex>  <name>`` or ``<hex> *<name>`` per line."""
    out: dict[str, str] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split(maxsplit=1)
        if len(parts) != 2:
            raise ValueError(f"line {lineno}: expected '<sha256>  <filename>'")
        digest, name = parts[0], parts[1].lstrip("*")
        if not _HEX64.fullmatch(digest):
            raise ValueError(f"line {lineno}: {digest[:80]!r} is not a 64-hex-digit sha256")
        if name in out:
            raise ValueError(f"line {lineno}: {name!r} listed twice")
        out[name] = digest
    return out


def _load_manifest(directory: Path, explicit: Mapping[str, str] | None, real_roots: list[Path] | None,
                   field: str) -> tuple[dict[str, str] | None, str]:
    """The manifest to check and the request field to blame for a bad entry in it."""
    if explicit is not None:
        manifest, source, blame = dict(explicit), "sha256_manifest", "sha256_manifest"
    elif os.path.lexists(directory / SHA256SUMS_FILE):
        real = _confined_file(directory, SHA256SUMS_FILE, real_roots, field)
        try:
            manifest = parse_sha256sums(real.read_text("utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise CheckpointInvalid(field, SHA256SUMS_FILE, None, f"is not a valid sha256sum file: {e}",
                                    code=CODE_BAD_MANIFEST) from None
        source, blame = SHA256SUMS_FILE, field
    else:
        return None, field
    for name, digest in manifest.items():
        if not _is_plain_name(name) or not isinstance(digest, str) or not _HEX64.fullmatch(digest):
            raise CheckpointInvalid(blame, name if _is_plain_name(name) else None, None,
                                    f"{source} entry {name!r}: need a plain file name and a 64-hex-digit sha256",
                                    code=CODE_BAD_MANIFEST)
    return {k: v.lower() for k, v in manifest.items()}, blame


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Streamed, so a multi-GB shard never sits in memory."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _verify_hashes(directory: Path, shard_files: Sequence[str], manifest: Mapping[str, str] | None,
                   compute_all: bool, real_roots: list[Path] | None, field: str, blame: str) -> dict[str, str] | None:
    if manifest is None and not compute_all:
        return None
    errors = _Collector()
    if manifest is not None:
        # An unlisted shard would be loaded unverified, defeating the point of a manifest.
        for name in shard_files:
            if name not in manifest:
                errors.add(CheckpointInvalid(blame, name, None, "is not covered by the sha256 manifest",
                                             code=CODE_BAD_MANIFEST))
        errors.raise_if_any()
    manifest = manifest or {}
    digests: dict[str, str] = {}
    for name in sorted(set(manifest) | set(shard_files)):
        try:
            digests[name] = sha256_file(_confined_file(directory, name, real_roots, field))
        except OSError as e:
            errors.add(CheckpointInvalid(blame, name, None, f"is listed in the sha256 manifest but cannot be read: "
                                         f"{e.strerror}", code=CODE_NOT_FOUND))
            continue
        if name in manifest and digests[name] != manifest[name]:
            errors.add(CheckpointInvalid(field, name, None, f"sha256 is {digests[name]}, manifest says "
                                         f"{manifest[name]}", code=CODE_SHA256_MISMATCH))
    errors.raise_if_any()
    return digests


# --------------------------------------------------------------------------- checkpoints


def _validate_structure(directory: Path, real_roots: list[Path] | None, field: str,
                        ) -> tuple[_Layout, dict[str, SafetensorsHeader], dict[str, str]]:
    """Layout, headers, duplicates and index: everything that does not need a model schema."""
    layout = _discover(directory, real_roots, field)
    headers = _read_headers(layout, real_roots, field)
    errors = _Collector()
    where = _tensor_locations(headers, errors, field)
    errors.raise_if_any()
    if layout.weight_map is not None:
        _check_index(layout.weight_map, headers, errors, field)
        errors.raise_if_any()
    return layout, headers, where


def schema_from_checkpoint_dir(path: str | os.PathLike[str]) -> dict[str, TensorSpec]:
    """The tensor schema of the BASE model, from its own safetensors headers.

    The base directory comes from the server's command line, so it is trusted and not
    confined to the checkpoint roots; its structure is still checked, because a broken
    base would make every later checkpoint look wrong. A hub id must be resolved to a
    local snapshot directory by the caller first.
    """
    directory = Path(os.path.realpath(path))
    _require_dir(directory, "model")
    _, headers, _ = _validate_structure(directory, None, "model")
    return {t.name: TensorSpec(t.shape, t.dtype) for h in headers.values() for t in h.tensors}


def validate_checkpoint(
    path: str,
    roots: Sequence[str | os.PathLike[str]],
    schema: Mapping[str, tuple[tuple[int, ...], str]],
    *,
    sha256_manifest: Mapping[str, str] | None = None,
    compute_sha256: bool = False,
    field: str = "path",
) -> ValidatedCheckpoint:
    """Check a full checkpoint against ``schema``; see the module docstring for the rules.

    ``compute_sha256`` hashes the shards even without a manifest (to report them).
    ``field`` is the request field a path or content error is blamed on.
    """
    started = time.monotonic()
    directory = resolve_confined(path, roots, field=field)
    _require_dir(directory, field)
    real_roots = _real_roots(roots)
    layout, headers, where = _validate_structure(directory, real_roots, field)
    errors = _Collector()
    _check_schema(headers, where, schema, errors, field)
    errors.raise_if_any()
    manifest, blame = _load_manifest(directory, sha256_manifest, real_roots, field)
    digests = _verify_hashes(directory, layout.shard_files, manifest, compute_sha256, real_roots, field, blame)
    shards = tuple(_shard_info(headers[f], f, digests, field) for f in layout.shard_files)
    return ValidatedCheckpoint(
        path=directory,
        shards=shards,
        total_bytes=sum(s.size_bytes for s in shards),
        has_index=layout.weight_map is not None,
        validation_time_s=time.monotonic() - started,
        sha256=digests,
    )


def _shard_info(header: SafetensorsHeader, file: str, digests: Mapping[str, str] | None, field: str) -> ShardInfo:
    st = os.stat(header.path)
    if st.st_size != header.file_size:
        # Checked the header of one size and now see another: someone is still writing it.
        raise CheckpointInvalid(field, file, None, "changed size during validation", code=CODE_BAD_LAYOUT)
    return ShardInfo(file, header.path, header.names, header.file_size, st.st_mtime_ns,
                     digests.get(file) if digests else None)


# --------------------------------------------------------------------------- pushes over the network

# torch's dtype names (what vLLM's update info carries as `dtype_names`) as safetensors names them.
TORCH_DTYPES: dict[str, str] = {
    "bool": "BOOL", "uint8": "U8", "int8": "I8", "float8_e5m2": "F8_E5M2", "float8_e4m3fn": "F8_E4M3",
    "float8_e8m0fnu": "F8_E8M0", "int16": "I16", "uint16": "U16", "float16": "F16", "bfloat16": "BF16",
    "int32": "I32", "uint32": "U32", "float32": "F32", "int64": "I64", "uint64": "U64", "float64": "F64",
}


# ... and back: a safetensors dtype as the manifest of the model digest names it.
SAFETENSORS_TO_TORCH: dict[str, str] = {st: t for t, st in TORCH_DTYPES.items()}


def checkpoint_sha256(validated: ValidatedCheckpoint, field: str = "sha256") -> str:
    """The model digest (sampler_common/weight_transfer/digest.py) of a validated checkpoint: each tensor's
    bytes read from its file (safetensors data is C-contiguous, little-endian: the tensor's own bytes), so
    a checkpoint written after a push over the network can be checked against the digest the pool
    declared. Reads the whole checkpoint; blocking (run it in a thread)."""
    from sampler_common.weight_transfer.digest import TensorRecord, model_sha256

    recs = []
    for shard in validated.shards:
        header = read_header(shard.path)
        with open(shard.path, "rb") as f:
            for t in header.tensors:
                f.seek(header.data_start + t.begin)
                h, left = hashlib.sha256(), t.nbytes
                while left:
                    block = f.read(min(left, 8 << 20))
                    if not block:
                        raise CheckpointInvalid(field, shard.file, t.name, "is shorter than its header says",
                                                code=CODE_TRUNCATED)
                    h.update(block)
                    left -= len(block)
                recs.append(TensorRecord(t.name, SAFETENSORS_TO_TORCH.get(t.dtype, t.dtype), t.shape, h.hexdigest()))
    return model_sha256(recs)


def schema_sizes(schema: Mapping[str, tuple[tuple[int, ...], str]]) -> list[int]:
    """The bytes of each tensor of the model: every push sends each once, with the schema's shape and dtype."""
    return [DTYPE_SIZES[dtype] * math.prod(shape) for shape, dtype in schema.values()]


def validate_tensor_metadata(names: Sequence[str], dtype_names: Sequence[str], shapes: Sequence[Sequence[int]],
                             schema: Mapping[str, tuple[tuple[int, ...], str]], *,
                             field: str = "update_info") -> int:
    """A push's tensors (names, torch dtype names and shapes, in the order they will be sent) against the
    served model's schema, by the same rules as a checkpoint: every tensor of the model exactly once,
    each with the schema's shape and dtype, nothing else. Errors name the tensor and the request field
    (`update_info.shapes[3]`); all of one kind come at once, the first raised. Returns the push's bytes."""
    errors = _Collector()
    seen: dict[str, int] = {}
    total = 0
    for i, (name, dtype_name, shape) in enumerate(zip(names, dtype_names, shapes, strict=True)):
        spec = schema.get(name)
        if name in seen:
            errors.add(CheckpointInvalid(f"{field}.names[{i}]", None, name, f"is sent twice (also at index "
                                         f"{seen[name]})", code=CODE_DUPLICATE_TENSOR))
            continue
        seen[name] = i
        if spec is None:
            errors.add(CheckpointInvalid(f"{field}.names[{i}]", None, name, "is not a tensor of the served model",
                                         code=CODE_UNKNOWN_TENSOR))
            continue
        want_shape, want_dtype = tuple(spec[0]), str(spec[1])
        dtype = TORCH_DTYPES.get(dtype_name)
        if tuple(shape) != want_shape:
            errors.add(CheckpointInvalid(f"{field}.shapes[{i}]", None, name, f"has shape {list(shape)}, model "
                                         f"expects {list(want_shape)}", code=CODE_SHAPE_MISMATCH))
        elif dtype != want_dtype:
            expected = next((t for t, st in TORCH_DTYPES.items() if st == want_dtype), want_dtype)
            errors.add(CheckpointInvalid(f"{field}.dtype_names[{i}]", None, name, f"has dtype {dtype_name!r}, model "
                                         f"expects {expected!r}", code=CODE_DTYPE_MISMATCH))
        else:
            total += DTYPE_SIZES[dtype] * math.prod(shape)
    for name in sorted(set(schema) - set(seen)):
        errors.add(CheckpointInvalid(f"{field}.names", None, name, "is missing: a push must send every tensor of "
                                     "the model", code=CODE_MISSING_TENSOR))
    errors.raise_if_any()
    return total


# --------------------------------------------------------------------------- LoRA adapters

# PEFT saves "<prefix><module path>.lora_A.weight" with the adapter name stripped.
_LORA_TENSOR = re.compile(r"(?P<module>.+)\.lora_(?P<ab>[AB])\.weight")
_PEFT_PREFIX = "base_model.model."
_FLOAT_DTYPES = frozenset({"F16", "BF16", "F32"})


def _is_positive_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


def _module_targeted(module: str, target_modules: list[str] | str) -> bool:
    # Same rule as PEFT: a string is a full-match regex over the module path, a list
    # matches the module path exactly or by its trailing dotted components.
    if isinstance(target_modules, str):
        return target_modules == "all-linear" or re.fullmatch(target_modules, module) is not None
    return any(module == t or module.endswith("." + t) for t in target_modules)


def _module_rank(module: str, config: Mapping[str, Any]) -> int:
    # PEFT's rank_pattern: the first key matching the end of the module path overrides r.
    for pattern, rank in (config.get("rank_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return int(rank)
    return int(config["r"])


def _check_adapter_config(config: object, max_rank: int, field: str) -> dict[str, Any]:
    def bad(why: str, code: str = CODE_BAD_ADAPTER_CONFIG) -> CheckpointInvalid:
        return CheckpointInvalid(field, ADAPTER_CONFIG_FILE, None, why, code=code)

    if not isinstance(config, dict):
        raise bad("is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise bad(f"peft_type is {config.get('peft_type')!r}, only LORA adapters are supported")
    if not _is_positive_int(config.get("r")):
        raise bad(f"'r' must be a positive integer, got {config.get('r')!r}")
    alpha = config.get("lora_alpha")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise bad(f"'lora_alpha' must be a number, got {alpha!r}")
    targets = config.get("target_modules")
    if not (isinstance(targets, str) and targets) and not (
        isinstance(targets, list) and targets and all(isinstance(t, str) and t for t in targets)
    ):
        raise bad(f"'target_modules' must be a non-empty list of names or a regex, got {targets!r}")
    if isinstance(targets, str) and targets != "all-linear":
        try:
            re.compile(targets)
        except re.error as e:
            raise bad(f"'target_modules' is not a valid regex: {e}") from None
    ranks = config.get("rank_pattern") or {}
    if not isinstance(ranks, dict) or not all(_is_positive_int(v) for v in ranks.values()):
        raise bad("'rank_pattern' must map module patterns to positive integers")
    if config.get("use_dora"):
        raise bad("DoRA adapters are not supported")
    top = max([config["r"], *ranks.values()])
    if top > max_rank:
        raise bad(f"rank {top} exceeds the server's max LoRA rank {max_rank}", code=CODE_RANK_TOO_LARGE)
    return config


def _group_lora_tensors(header: SafetensorsHeader, field: str) -> dict[str, dict[str, TensorEntry]]:
    """module -> {"A": entry, "B": entry}; anything that is not a LoRA A/B weight is refused."""
    errors = _Collector()
    modules: dict[str, dict[str, TensorEntry]] = {}
    for t in header.tensors:
        m = _LORA_TENSOR.fullmatch(t.name)
        if m is None:
            errors.add(CheckpointInvalid(field, ADAPTER_WEIGHTS_FILE, t.name, "is not a PEFT "
                                         "'<module>.lora_A.weight' / '<module>.lora_B.weight' tensor",
                                         code=CODE_BAD_LORA_TENSOR))
            continue
        module = m["module"].removeprefix(_PEFT_PREFIX)
        modules.setdefault(module, {})[m["ab"]] = t
    errors.raise_if_any()
    if not modules:
        raise CheckpointInvalid(field, ADAPTER_WEIGHTS_FILE, None, "contains no LoRA tensors",
                                code=CODE_BAD_LORA_TENSOR)
    return modules


def _check_lora_module(module: str, pair: Mapping[str, TensorEntry], config: Mapping[str, Any],
                       base_schema: Mapping[str, tuple[tuple[int, ...], str]] | None,
                       errors: _Collector, field: str) -> LoraModule | None:
    def bad(tensor: str | None, why: str) -> None:
        errors.add(CheckpointInvalid(field, ADAPTER_WEIGHTS_FILE, tensor, f"module {module!r}: {why}",
                                     code=CODE_BAD_LORA_TENSOR))

    if set(pair) != {"A", "B"}:
        have = next(iter(pair.values()))
        bad(have.name, f"has lora_{next(iter(pair))} without its lora_{'B' if 'A' in pair else 'A'} partner")
        return None
    a, b = pair["A"], pair["B"]
    if not _module_targeted(module, config["target_modules"]):
        bad(a.name, f"is not matched by target_modules {config['target_modules']!r}")
        return None
    for t in (a, b):
        if t.dtype not in _FLOAT_DTYPES or len(t.shape) != 2:
            bad(t.name, f"must be a 2-D F16/BF16/F32 tensor, is {t.dtype} {list(t.shape)}")
            return None
    rank = _module_rank(module, config)
    # lora_A: (r, in_features), lora_B: (out_features, r).
    if a.shape[0] != rank or b.shape[1] != rank:
        bad(a.name if a.shape[0] != rank else b.name,
            f"shapes A {list(a.shape)} / B {list(b.shape)} do not match rank {rank}")
        return None
    lora = LoraModule(module, rank, in_features=a.shape[1], out_features=b.shape[0])
    if base_schema is not None:
        _check_against_base(lora, a.name, config, base_schema, bad)
    return lora


def _check_against_base(lora: LoraModule, tensor: str, config: Mapping[str, Any],
                        base_schema: Mapping[str, tuple[tuple[int, ...], str]],
                        bad: Callable[[str | None, str], None]) -> None:
    base = base_schema.get(f"{lora.name}.weight")
    if base is None:
        bad(tensor, f"the base model has no tensor {lora.name + '.weight'!r} to adapt")
        return
    # Conv1D-style modules (fan_in_fan_out) store the base weight as (in, out).
    out_in = tuple(base[0])[::-1] if config.get("fan_in_fan_out") else tuple(base[0])
    if out_in != (lora.out_features, lora.in_features):
        bad(tensor, f"adapts a {list(base[0])} base weight but implies (out, in) = "
                    f"({lora.out_features}, {lora.in_features})")


def validate_lora_adapter(
    path: str,
    roots: Sequence[str | os.PathLike[str]],
    *,
    max_rank: int,
    base_schema: Mapping[str, tuple[tuple[int, ...], str]] | None = None,
    sha256_manifest: Mapping[str, str] | None = None,
    field: str = "path",
) -> ValidatedLoraAdapter:
    """Check a local PEFT LoRA directory (``adapter_config.json`` + ``adapter_model.safetensors``).

    With ``base_schema`` (from ``schema_from_checkpoint_dir``) each adapted module must
    exist in the base model with matching in/out features. Pickled ``adapter_model.bin``
    adapters are refused: loading them would execute arbitrary code.
    """
    started = time.monotonic()
    directory = resolve_confined(path, roots, field=field)
    _require_dir(directory, field)
    real_roots = _real_roots(roots)
    for name in (ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE):
        if not os.path.lexists(directory / name):
            raise CheckpointInvalid(field, name, None, "is missing from the adapter directory", code=CODE_NOT_FOUND)
    config_path = _confined_file(directory, ADAPTER_CONFIG_FILE, real_roots, field)
    config = _check_adapter_config(_read_json_file(config_path, ADAPTER_CONFIG_FILE, field, CODE_BAD_ADAPTER_CONFIG),
                                   max_rank, field)
    layout = _Layout(directory, (ADAPTER_WEIGHTS_FILE,), None)
    header = _read_headers(layout, real_roots, field)[ADAPTER_WEIGHTS_FILE]
    errors = _Collector()
    modules = [
        m for module, pair in sorted(_group_lora_tensors(header, field).items())
        if (m := _check_lora_module(module, pair, config, base_schema, errors, field)) is not None
    ]
    errors.raise_if_any()
    manifest, blame = _load_manifest(directory, sha256_manifest, real_roots, field)
    digests = _verify_hashes(directory, (ADAPTER_WEIGHTS_FILE,), manifest, False, real_roots, field, blame)
    return ValidatedLoraAdapter(
        path=directory,
        rank=config["r"],
        max_module_rank=max(m.rank for m in modules),
        lora_alpha=float(config["lora_alpha"]),
        target_modules=config["target_modules"],
        modules=tuple(modules),
        weights=_shard_info(header, ADAPTER_WEIGHTS_FILE, digests, field),
        config=config,
        validation_time_s=time.monotonic() - started,
        sha256=digests,
    )
