"""What a request's model name means on a pool with adapters (pure): the base model, or exactly one
version of one run (docs/design/lora-pool.md, "Naming a version").

| the client writes | means |
|---|---|
| a name of the base model (`Qwen/Qwen3-0.6B`, `qwen3-0.6b`; case-insensitive) | the base model |
| `<run>` | the run's newest declared version ("latest"), under the pool's version policy per run |
| `<run>@<step>` | that version (pinned) |
| `tinker://<run>/sampler_weights/<label>` | that version (pinned): as Tinker's `save_weights_for_sampler` names it |

Anything else is a 404 naming `model_path` (or the field the route reads the name from): an unknown
run, a version the run never had or whose cap dropped it. Never the base model in its place, never
another run's version: a resolved version is always one of the run the client named.

"Latest" per run (`RunOrder`): a request for `<run>` is sent to the newest version declared when it
is routed, and every version's weights are fixed (each has its own engine name), so an answer is
exactly as new as the version it was routed to. Two requests routed across a push can still come
back out of order; under the `Latest` policy the older one is then not returned, as for full weights
(`versions.is_stale`): a client never gets an answer on an older version of R after a newer one. Nor
once the gateway routes by a declared state with a newer step of R: another gateway may have returned
it (and a push answers only once every gateway routes by it: adapter_acks.py). A pinned request
asked for its version and is always returned.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import PurePosixPath

from sampler_common.adapters import RUN_RE, AdapterState, AdapterVersion
from sampler_common.errors import NotFound

from ..config import VersionPolicy

TINKER_PREFIX = "tinker://"
SAMPLER_WEIGHTS = "sampler_weights"
_ENGINE_NAME = re.compile(r"([^.]+)\.([0-9]+)\.([0-9]+)")  # <run>.<step>.<serial>
# How many runs or versions an error lists: enough to spot a typo, bounded on a pool with many.
_LISTED = 10


def base_names(model: str) -> set[str]:
    """The names a request may give the base model: the template's `model`, and its last path
    segment, case-insensitive (as a replica's `served_names`)."""
    names = {model.lower()}
    tail = PurePosixPath(model).name
    if tail:
        names.add(tail.lower())
    return names


@dataclass(frozen=True)
class BaseTarget:
    """The base model: no adapter."""


@dataclass(frozen=True)
class VersionTarget:
    run: str
    version: AdapterVersion
    pinned: bool  # the client named this version (`<run>@<step>`, a tinker:// path), not `<run>`

    @property
    def engine_name(self) -> str:
        return self.version.engine_name(self.run)


Target = BaseTarget | VersionTarget


def _listed(items: list[str]) -> str:
    more = f" and {len(items) - _LISTED} more" if len(items) > _LISTED else ""
    return ", ".join(items[:_LISTED]) + more


def _unknown_run(name: str, run: str, state: AdapterState, fieldname: str) -> NotFound:
    runs = sorted(state.runs)
    known = f"the pool declares runs {_listed(runs)}" if runs else "the pool declares no adapter"
    return NotFound(f"{fieldname} {name!r}: no run {run!r}; {known}", field=fieldname)


def _parse(name: str, fieldname: str) -> tuple[str, int | None, str | None]:
    """(run, step, label) named by `name`; step and label both None for `<run>`."""
    if name.startswith(TINKER_PREFIX):
        parts = name[len(TINKER_PREFIX):].strip("/").split("/")
        if len(parts) != 3 or parts[1] != SAMPLER_WEIGHTS or not parts[0] or not parts[2]:
            raise NotFound(f"{fieldname} {name!r}: a pool's adapter path is "
                           f"tinker://<run>/{SAMPLER_WEIGHTS}/<version_label>", field=fieldname)
        return parts[0], None, parts[2]
    run, at, step = name.partition("@")
    if at:
        if not step.isdigit():
            raise NotFound(f"{fieldname} {name!r}: a pinned version is <run>@<step>, the step an integer",
                           field=fieldname)
        return run, int(step), None
    return run, None, None


def resolve(name: str, state: AdapterState, model: str, *, fieldname: str = "model_path") -> Target:
    """The base model or the one version `name` selects (table above); else 404 naming `fieldname`."""
    if name.lower() in base_names(model):
        return BaseTarget()
    run_name, step, label = _parse(name, fieldname)
    run = state.runs.get(run_name) if RUN_RE.fullmatch(run_name) else None
    if run is None:
        raise _unknown_run(name, run_name, state, fieldname)
    if step is None and label is None:
        return VersionTarget(run=run_name, version=run.newest, pinned=False)
    version = run.by_step(step) if step is not None else run.by_label(str(label))
    if version is None:
        have = _listed([f"{v.step} ({v.label})" for v in reversed(run.versions)])
        raise NotFound(f"{fieldname} {name!r}: run {run_name!r} has no such version (its cap keeps "
                       f"{state.max_versions_per_run}); it declares steps {have}", field=fieldname)
    return VersionTarget(run=run_name, version=version, pinned=True)


def sampled_by(engine: str, declared: Mapping[str, tuple[str, AdapterVersion]]
               ) -> tuple[str, int, AdapterVersion | None] | None:
    """The run, step and (while declared) version of the replica's adapter `engine`. A version no
    longer declared (its run's cap dropped it since it was sampled) is still known by its run and
    step, which its engine name carries. None: not an engine name of the pool's (a replica's own
    `--initial-adapters`)."""
    found = declared.get(engine)
    if found is not None:
        return found[0], found[1].step, found[1]
    parts = _ENGINE_NAME.fullmatch(engine)
    if parts is None or not RUN_RE.fullmatch(parts[1]):
        return None
    return parts[1], int(parts[2]), None


def answered_as(engine: str, declared: Mapping[str, tuple[str, AdapterVersion]]) -> tuple[str, str | None] | None:
    """What an answer sampled by the replica's adapter `engine` tells the client: `<run>@<step>` and
    the version's label (none for a version no longer declared). None: not an engine name of the
    pool's: the replica's own name stands."""
    found = sampled_by(engine, declared)
    if found is None:
        return None
    run, step, version = found
    return f"{run}@{step}", version.label if version is not None else None


@dataclass
class RunOrder:
    """The newest step this gateway returned per run, for `<run>` requests under `Latest`."""

    newest_returned: dict[str, int] = field(default_factory=dict)

    def is_stale(self, target: VersionTarget, policy: VersionPolicy, declared: AdapterState | None = None) -> bool:
        """An answer not to return: `<run>` under Latest, on a step older than one already returned,
        or than the run's newest step in `declared` (the state this gateway routes by): another
        gateway may have returned that step already (adapter_acks.py). (MinVersion's floor is a
        full-weights label: for runs it is Any.)"""
        return not target.pinned and self.is_stale_step(target.run, target.version.step, policy, declared)

    def is_stale_step(self, run_name: str, step: int, policy: VersionPolicy,
                      declared: AdapterState | None = None) -> bool:
        """`is_stale` for an answer on `step` of `run_name` to a `<run>` request: a future's result,
        known by its engine name, which may be a version the run's cap dropped since."""
        return policy == "Latest" and step < self.newest(run_name, declared)

    def newest(self, run_name: str, declared: AdapterState | None = None) -> int:
        """The newest step of `run_name` this gateway returned or routes by (-1: none): what an
        answer to a `<run>` request must not be older than under Latest."""
        run = declared.runs.get(run_name) if declared is not None else None
        return max(self.newest_returned.get(run_name, -1), run.newest.step if run is not None and run.versions else -1)

    def returned(self, target: VersionTarget) -> None:
        if not target.pinned:
            self.returned_step(target.run, target.version.step)

    def returned_step(self, run: str, step: int) -> None:
        self.newest_returned[run] = max(self.newest_returned.get(run, -1), step)
