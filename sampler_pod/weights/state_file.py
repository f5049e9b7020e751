"""The replica's intended weights on disk: what it must come back at after a container restart.

The file lives on the pod's emptyDir (next to the engine startup lock), so it survives a
container restart but not a pod replacement; a replacement gets the same facts from the
operator, which reads them from `/health` (`intended`, `adapters`) into the `--initial-*` flags.
It records the loads that trainers send straight to the pod's HTTP API, which the operator's
flags cannot know of yet, so at startup the file wins over the flags.

Written atomically (a temporary file in the same directory, fsync, `os.replace`): a crash
leaves the old file or the new one, never half of one. A file that does not parse is not
trusted: startup logs a warning and falls back to the flags (it never crashes on it).

There is no default path: without `--weights-state-path` nothing is recorded or read. A default
would be one file per machine, not per sampler, and two samplers on one host would restore each
other's weights (issue #23). The operator always passes a path on the pod's own emptyDir.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path

from pydantic import BaseModel, Field, ValidationError, model_validator

from sampler_common.errors import SamplerError

log = logging.getLogger(__name__)


class StatePersistFailed(SamplerError):
    """The intended state could not be recorded: the mutation was not made (nothing was written)."""

    status_code = 500
    category = "state_write_failed"


class PersistedAdapter(BaseModel):
    name: str = Field(..., min_length=1)
    path: str = Field(..., min_length=1)


class PersistedWeights(BaseModel):
    """`{"checkpoint", "version_label", "sha256_manifest", "step", "sha256", "adapters": [{"name", "path"}]}`.
    Weights pushed over the network have a label and a model digest (`sha256`) but no checkpoint: a
    restart cannot load them from anywhere yet, and waits, unready (weights/startup.py)."""

    checkpoint: str | None = Field(None, min_length=1)
    version_label: str | None = Field(None, min_length=1)
    sha256_manifest: dict[str, str] | None = None
    # The training step of the checkpoint: a restart reports it again (absent in older files).
    step: int | None = Field(None, ge=0)
    # The model digest of weights pushed over the network (absent for a checkpoint, and in older files).
    sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    adapters: list[PersistedAdapter] = Field(default_factory=list)

    @model_validator(mode="after")
    def _checkpoint_has_label(self) -> PersistedWeights:
        if self.checkpoint is not None and self.version_label is None:
            raise ValueError("checkpoint and version_label go together")
        if self.version_label is not None and self.checkpoint is None and self.sha256 is None:
            raise ValueError("a version_label without a checkpoint needs the sha256 of the weights pushed")
        return self

    @property
    def pushed(self) -> bool:
        """Weights pushed over the network: a label and a digest, nothing to load them from."""
        return self.version_label is not None and self.checkpoint is None

    @property
    def empty(self) -> bool:
        return self.version_label is None and not self.adapters


def read_state(path: Path | None) -> PersistedWeights | None:
    """The recorded state; None if there is none (no file, or no `--weights-state-path`), or if it is
    unreadable (with a warning)."""
    if path is None:
        return None
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning("cannot read the weights state file %s (%s); falling back to the --initial-* flags", path, e)
        return None
    try:
        return PersistedWeights.model_validate(json.loads(text))
    except (json.JSONDecodeError, ValidationError, UnicodeDecodeError) as e:
        log.warning("weights state file %s is corrupt (%s); falling back to the --initial-* flags",
                    path, str(e).splitlines()[0])
        return None


def write_state(path: Path | None, state: PersistedWeights) -> None:
    """Replace the recorded state atomically. Raises `StatePersistFailed` (and leaves the old file).
    No path (`--weights-state-path` unset): nothing is recorded, by choice."""
    if path is None:
        return
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "w") as f:
            f.write(state.model_dump_json(indent=2) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise StatePersistFailed(f"could not record the intended weights in {path}: {e}; nothing was changed "
                                 "(a restart would not come back at these weights)") from e
