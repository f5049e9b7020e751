"""Static discovery: a fixed list of replicas (`--replica NAME=URL`), or a JSON file,
`[{"name": "r0", "url": "http://127.0.0.1:8001", "draining": false}, ...]`, so a test (or a script
outside Kubernetes) adds, removes or drains replicas by rewriting it (write, then rename).

The file is watched by its stat (inode, size, mtime) every `POLL_S`: a stat costs microseconds, so
a rewrite is acted on within that tick, and the file is read again only when its stat changed.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator

from ..ids import valid_replica_name
from ..replicas import Member
from .source import Membership

POLL_S = 0.05

# What tells a rewrite apart: a rename gives a new inode, an in-place write a new size or mtime.
Stamp = tuple[int, int, int] | None


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


def stamp_of(path: Path) -> Stamp:
    try:
        st = os.stat(path)
    except OSError:
        return None  # missing (between a delete and a rename): a change like any other
    return st.st_ino, st.st_size, st.st_mtime_ns


class StaticDiscovery:
    def __init__(self, members: list[tuple[str, str]], path: Path | None) -> None:
        for name, _ in members:
            if not valid_replica_name(name):
                raise ValueError(f"replica name {name!r} must be a Kubernetes object name")
        self.fixed = tuple(Member(n, u) for n, u in members)
        self.path = path
        self._last_file: tuple[Member, ...] = ()
        self._read: Stamp | str = "never"  # the stamp of the file as last read

    async def membership(self) -> Membership:
        if self.path is None:
            return Membership(self.fixed)
        stamp = stamp_of(self.path)  # before the read: a rewrite during it is read again next time
        if stamp != self._read:
            self._read = stamp
            try:
                self._last_file = await asyncio.to_thread(read_replicas_file, self.path)
            except (OSError, ValueError):
                pass  # a broken or missing file: keep the last good list until the file changes again
        return Membership(self.fixed + self._last_file)

    async def changed(self) -> None:
        path = self.path
        if path is None:
            await asyncio.Event().wait()  # a fixed list never changes
            return
        while stamp_of(path) == self._read:
            await asyncio.sleep(POLL_S)

    def close(self) -> None:
        return None
