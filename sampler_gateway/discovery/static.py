"""Static discovery: a fixed list of replicas (`--replica NAME=URL`), or a JSON file re-read on every
refresh, `[{"name": "r0", "url": "http://127.0.0.1:8001", "draining": false}, ...]`, so a test (or a
script outside Kubernetes) adds, removes or drains replicas by rewriting it (write, then rename).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator

from ..ids import valid_replica_name
from ..replicas import Member
from .source import Membership


class FileEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    url: str = Field(..., pattern=r"^https?://")
    draining: bool = False

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not valid_replica_name(v):
            raise ValueError("must be a Kubernetes object name (lowercase alphanumerics, '-', '.')")
        return v


_FILE = TypeAdapter(list[FileEntry])


def read_replicas_file(path: Path) -> tuple[Member, ...]:
    entries = _FILE.validate_json(path.read_bytes())
    return tuple(Member(e.name, e.url.rstrip("/"), e.draining) for e in entries)


class StaticDiscovery:
    def __init__(self, members: list[tuple[str, str]], path: Path | None) -> None:
        for name, _ in members:
            if not valid_replica_name(name):
                raise ValueError(f"replica name {name!r} must be a Kubernetes object name")
        self.fixed = tuple(Member(n, u) for n, u in members)
        self.path = path
        self._last_file: tuple[Member, ...] = ()

    async def membership(self) -> Membership:
        if self.path is None:
            return Membership(self.fixed)
        try:
            self._last_file = await asyncio.to_thread(read_replicas_file, self.path)
        except (OSError, ValueError):
            pass  # a file being rewritten or broken: keep the last good list (logged by the caller's view)
        return Membership(self.fixed + self._last_file)

    def close(self) -> None:
        return None
