"""A pool's declared LoRA adapters (`spec.adapters` of a SamplerPool): runs, each with its versions.

Why here, under both servers: the gateway writes this state (a trainer's push) and routes by it, and
the operator will report it in the pool's status; both read the same object, so the shape and its
rules are defined once (docs/design/lora-pool.md).

A **run** is one training run's adapter (`math-rl`); a **version** is one push of it: a label (the
trainer's name for it, the last segment of its `tinker://<run>/sampler_weights/<label>` path), a
training step (orders the run's versions), the adapter directory inside the replicas' pods, and a
serial, given by the pool, unique among every version the pool ever declared. Each version is
registered in the engine under its own name (`engine_name`): vLLM hashes the prefix cache by
adapter name, and a replica holds adapters by name, so two versions never share either.

The model is pydantic at the edge only: it parses what the API server holds (camelCase, as in the
CRD) and renders it back; the decisions on it are pure functions elsewhere (the gateway's
`admin/adapter_push.py`, `lora/names.py`, `lora/placement.py`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import Conflict

# A run's name: what a client writes as the OpenAI `model` (`<run>`, `<run>@<step>`) and in a
# `tinker://<run>/...` path. No `.` (an engine name is `<run>.<step>.<serial>`, split on dots), no `@`
# or `/` (they delimit a step and a path). 63 characters: a Kubernetes label value, should the
# operator ever label by run.
RUN_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$"
# A version's label: a path segment of `tinker://<run>/sampler_weights/<label>`.
LABEL_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$"
RUN_RE, LABEL_RE = re.compile(RUN_PATTERN), re.compile(LABEL_PATTERN)

# A pool's gateway names the version a request runs on (its engine name) in this header, where the
# protocol's own field names the run (Twinkle's `adapter_name`): the replica samples that version.
POOL_ADAPTER_HEADER = "X-Sampler-Pool-Adapter"
# The adapter an answer was sampled with (absent: the base model): a replica writes its engine name
# there, a pool's gateway the client's name for the version, `<run>@<step>`.
ADAPTER_HEADER = "X-Sampler-Adapter"

DEFAULT_MAX_VERSIONS_PER_RUN = 4
DEFAULT_MAX_RUNS = 64
# The CRD's maxima.
MAX_VERSIONS_PER_RUN = 16
MAX_RUNS = 128
# What spec.adapters may take of the pool object, as compact JSON. etcd refuses an object over
# 1.5 MiB, and the pool holds its template and status besides. A version with a two-file manifest is
# about 0.3 KB, so the defaults (64 runs x 4 versions) take about 80 KB; the maxima (128 x 16) would
# take about 600 KB, and long paths or manifests more: the budget, not the counts, is the bound.
MAX_SPEC_BYTES = 512 * 1024


class _Model(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="ignore", frozen=True)


class AdapterVersion(_Model):
    label: str = Field(pattern=LABEL_PATTERN)
    step: int = Field(ge=0)
    path: str = Field(min_length=1)
    serial: int = Field(ge=1)
    sha256_manifest: dict[str, str] | None = Field(None, alias="sha256Manifest")
    # Kept when the run's version cap drops older versions (an evaluation baseline, say).
    pinned: bool = False

    def engine_name(self, run: str) -> str:
        """The name this version is registered under in every replica's engine. The serial makes it
        unique for the pool's lifetime: a run deleted by hand and pushed again from step 0 never
        meets a replica still holding the old `run.0` (its weights, or its cached prefixes)."""
        return engine_name(run, self.step, self.serial)


def engine_name(run: str, step: int, serial: int) -> str:
    return f"{run}.{step}.{serial}"


class AdapterRun(_Model):
    """One run's versions, oldest first (by step; the API server keeps any order a hand edit wrote,
    so it is sorted here). Steps and labels are each unique in a run."""

    versions: tuple[AdapterVersion, ...] = Field(min_length=1)

    @field_validator("versions")
    @classmethod
    def _ordered(cls, versions: tuple[AdapterVersion, ...]) -> tuple[AdapterVersion, ...]:
        out = tuple(sorted(versions, key=lambda v: v.step))
        for field, values in (("step", [v.step for v in out]), ("label", [v.label for v in out])):
            if len(set(values)) != len(values):
                raise ValueError(f"two versions share a {field}")
        return out

    @property
    def newest(self) -> AdapterVersion:
        return self.versions[-1]

    def by_step(self, step: int) -> AdapterVersion | None:
        return next((v for v in self.versions if v.step == step), None)

    def by_label(self, label: str) -> AdapterVersion | None:
        return next((v for v in self.versions if v.label == label), None)


class AdapterState(_Model):
    """`spec.adapters`: the limits, the last serial given, and the runs by name."""

    max_versions_per_run: int = Field(DEFAULT_MAX_VERSIONS_PER_RUN, alias="maxVersionsPerRun", ge=1,
                                      le=MAX_VERSIONS_PER_RUN)
    max_runs: int = Field(DEFAULT_MAX_RUNS, alias="maxRuns", ge=1, le=MAX_RUNS)
    serial: int = Field(0, ge=0)
    runs: dict[str, AdapterRun] = Field(default_factory=dict)

    @field_validator("runs")
    @classmethod
    def _run_names(cls, runs: dict[str, AdapterRun]) -> dict[str, AdapterRun]:
        bad = sorted(r for r in runs if not RUN_RE.fullmatch(r))
        if bad:
            raise ValueError(f"run names {bad} do not match {RUN_PATTERN}")
        return runs

    @model_validator(mode="after")
    def _serials(self) -> AdapterState:
        serials = [v.serial for run in self.runs.values() for v in run.versions]
        if len(set(serials)) != len(serials):
            raise ValueError("two versions share a serial")
        return self

    @property
    def next_serial(self) -> int:
        """The serial the next pushed version gets: above the counter and above every serial still
        declared (a counter removed by hand never makes a name be given twice)."""
        return max([self.serial, *(v.serial for run in self.runs.values() for v in run.versions)]) + 1

    def engine_names(self) -> dict[str, tuple[str, AdapterVersion]]:
        """Every declared version by its engine name: what a replica's loaded adapters are read against."""
        return {v.engine_name(name): (name, v) for name, run in self.runs.items() for v in run.versions}

    def spec_bytes(self) -> int:
        """The size of `to_spec()` as compact JSON: what it adds to the pool object, roughly."""
        return len(json.dumps(self.to_spec(), separators=(",", ":")))

    def to_spec(self) -> dict[str, Any]:
        """As the CRD holds it (camelCase; absent manifests left out)."""
        out: dict[str, Any] = self.model_dump(by_alias=True, exclude_none=True, mode="json")
        return out


def adapter_state(pool: Mapping[str, Any]) -> AdapterState:
    """The declared adapters of a SamplerPool object (none declared: an empty state with the defaults).
    A state a hand edit made inconsistent (two versions of a run at one step, say) is a 409 naming
    `spec.adapters`: no push is decided on it, and routing keeps what it last read."""
    raw = (pool.get("spec") or {}).get("adapters") or {}
    try:
        return AdapterState.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise Conflict(f"the pool's spec.adapters is inconsistent ({where}: {first.get('msg')}); fix it by hand",
                       field="spec.adapters") from None
