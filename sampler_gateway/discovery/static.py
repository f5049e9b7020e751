"""Static discovery: a fixed list of replicas (`--replica NAME=URL`), or a JSON file,
`[{"name": "r0", "url": "http://127.0.0.1:8001", "draining": false}, ...]`, so a test (or a script
outside Kubernetes) adds, removes or drains replicas by rewriting it (write, then rename).

Without a SamplerPool there is no `spec.adapters`: `--adapters-file` stands in for it, a JSON object
as the CRD spells `spec.adapters` (`{"runs": {"math-rl": {"versions": [{"label", "step", "path",
"serial"}]}}}`), re-read when it changes as the replicas file is. The seam through which the
gateway's tests (and a pool run outside Kubernetes) declare adapters; kube discovery reads the
pool object instead (kube.py).

The file is watched by its stat (inode, size, mtime) every `POLL_S`: a stat costs microseconds, so
a rewrite is acted on within that tick, and the file is read again only when its stat changed.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator

from sampler_common.adapters import AdapterState, adapter_state
from sampler_common.errors import Conflict

from ..replicas.ids import valid_replica_name
from ..replicas.view import Member
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


def read_adapters_file(path: Path) -> AdapterState:
    raw = json.loads(path.read_bytes())
    return adapter_state({"spec": {"adapters": raw}})


def stamp_of(path: Path) -> Stamp:
    try:
        st = os.stat(path)
    except OSError:
        return None  # missing (between a delete and a rename): a change like any other
    return st.st_ino, st.st_size, st.st_mtime_ns


class StaticDiscovery:
    def __init__(self, members: list[tuple[str, str]], path: Path | None, adapters_path: Path | None = None) -> None:
        for name, _ in members:
            if not valid_replica_name(name):
                raise ValueError(f"replica name {name!r} must be a Kubernetes object name")
        self.fixed = tuple(Member(n, u) for n, u in members)
        self.path = path
        self._last_file: tuple[Member, ...] = ()
        self._read: Stamp | str = "never"  # the stamp of the file as last read
        self.adapters_path = adapters_path
        self._adapters: AdapterState | None = None
        self._adapters_read: Stamp | str = "never"

    async def membership(self) -> Membership:
        if self.adapters_path is not None:
            stamp = stamp_of(self.adapters_path)
            if stamp != self._adapters_read:
                self._adapters_read = stamp
                try:
                    self._adapters = await asyncio.to_thread(read_adapters_file, self.adapters_path)
                except (OSError, ValueError, Conflict):
                    pass  # as a broken replicas file: the last good state stays
        if self.path is None:
            return Membership(self.fixed, adapters=self._adapters)
        stamp = stamp_of(self.path)  # before the read: a rewrite during it is read again next time
        if stamp != self._read:
            self._read = stamp
            try:
                self._last_file = await asyncio.to_thread(read_replicas_file, self.path)
            except (OSError, ValueError):
                pass  # a broken or missing file: keep the last good list until the file changes again
        return Membership(self.fixed + self._last_file, adapters=self._adapters)

    def _unchanged(self) -> bool:
        return ((self.path is None or stamp_of(self.path) == self._read) and
                (self.adapters_path is None or stamp_of(self.adapters_path) == self._adapters_read))

    async def changed(self) -> None:
        if self.path is None and self.adapters_path is None:
            await asyncio.Event().wait()  # a fixed list never changes
            return
        while self._unchanged():
            await asyncio.sleep(POLL_S)

    def close(self) -> None:
        return None
