"""An adapter push, decided here (pure): may this version become the run's newest, and what is the
pool's declared adapter state after it (docs/design/lora-pool.md, "A push").

A trainer pushes one version per step, as it pushes full weights: through the gateway, with the
pool's admin key. The push is checked against the state it then writes (the read's resourceVersion,
as `admin.weights.weights_patch`): two trainers, or a trainer and the operator's status writes, never
interleave a check and a write. What is checked here is what the declared state and the path can
tell; the adapter's files (rank, target modules, a corrupt or partial file) only a replica can check,
before the state is written (the push route loads it on one replica first: `admin/adapters.py`).

- `run`: the syntax of `sampler_common.adapters.RUN_PATTERN`, not a name of the base model (a
  request for it would be ambiguous), and at most `maxRuns` runs (400 / 409 naming `run`);
- `step`: strictly newer than the run's newest (409 naming `step`): a run's versions are one order,
  and `<run>` (latest) must never go back. An exact repeat of the run's newest version (same step,
  label, path, manifest) changes nothing and answers as the first did: a trainer that retries a push
  whose answer it lost is not refused;
- `version_label`: unique in the run (409 naming it), since `tinker://<run>/sampler_weights/<label>`
  names a version by it;
- `path`: absolute, no `..`, under the template's `checkpoints.allowedRoots` (400 naming `path`);
- the cap: a run keeps at most `maxVersionsPerRun` versions; a push past it drops the oldest
  unpinned ones. When only pinned versions are left to drop, the push is refused (409 naming
  `pinned`) rather than growing the pool object without bound.
- the size: the declared adapters stay under `MAX_SPEC_BYTES` of the pool object (409 naming
  `spec.adapters`): long paths and manifests cannot push the object past etcd's limit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sampler_common.adapters import (
    LABEL_PATTERN,
    MAX_SPEC_BYTES,
    RUN_PATTERN,
    AdapterRun,
    AdapterState,
    AdapterVersion,
)
from sampler_common.errors import Conflict, InvalidRequest, validation_error

from ..lora.names import SAMPLER_WEIGHTS, TINKER_PREFIX, base_names
from .weights import check_checkpoint


class AdapterPush(BaseModel):
    """`POST /v1/pool/adapters`: one version of a run, in the sampler API's snake_case."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    run: str = Field(pattern=RUN_PATTERN, description="the training run whose adapter this is")
    path: str = Field(min_length=1, description="the PEFT adapter directory inside the replicas' pods")
    version_label: str = Field(pattern=LABEL_PATTERN, description="the version's name in its run")
    step: int = Field(ge=0, description="the trainer's training step: orders the run's versions")
    sha256_manifest: dict[str, str] | None = Field(None, description="file -> sha256 each replica verifies")
    pinned: bool = Field(False, description="kept when the run's version cap drops older versions")
    # What the push waits for; not part of the declared version (a repeat may ask for more).
    servable: Literal["one", "all"] = Field(
        "one", description="the push answers once the version is loaded and routable on one replica (`one`), or "
                           "on every replica that holds a version of the run (`all`)")


def parse_adapter_push(body: Any) -> AdapterPush:
    try:
        return AdapterPush.model_validate(body)
    except ValidationError as e:
        raise validation_error(e) from None


@dataclass(frozen=True)
class PushDecision:
    state: AdapterState  # the declared state after the push
    version: AdapterVersion  # the pushed version, as declared (with its serial)
    dropped: tuple[AdapterVersion, ...] = ()  # versions of the run the cap dropped
    changed: bool = True  # False: a repeat of the run's newest version; nothing to write


def _same(version: AdapterVersion, push: AdapterPush) -> bool:
    return (version.step, version.label, version.path, version.sha256_manifest, version.pinned) == (
        push.step, push.version_label, push.path, push.sha256_manifest, push.pinned)


def decide_push(state: AdapterState, push: AdapterPush, *, roots: list[str], model: str) -> PushDecision:
    """The declared state after `push`, or the error that leaves it as it is. `roots`: the pool
    template's `checkpoints.allowedRoots`; `model`: the template's base model."""
    if push.run.lower() in base_names(model):
        raise InvalidRequest(f"run {push.run!r} is a name of the pool's base model {model!r}: a request for it "
                             "would be ambiguous; name the run otherwise", field="run")
    check_checkpoint(push.path, roots, field="path")
    run = state.runs.get(push.run)
    if run is None and len(state.runs) >= state.max_runs:
        raise Conflict(f"run {push.run!r}: the pool holds {len(state.runs)} runs, its spec.adapters.maxRuns",
                       field="run")
    versions: list[AdapterVersion] = list(run.versions) if run else []
    if run is not None:
        newest = run.newest
        if _same(newest, push):
            return PushDecision(state=state, version=newest, changed=False)
        if push.step <= newest.step:
            raise Conflict(f"step {push.step} of run {push.run!r} is not newer than its newest version, step "
                           f"{newest.step} ({newest.label!r}): a run's steps only grow", field="step")
        if run.by_label(push.version_label) is not None:
            raise Conflict(f"version_label {push.version_label!r} already names a version of run {push.run!r}",
                           field="version_label")
    serial = state.next_serial
    version = AdapterVersion(label=push.version_label, step=push.step, path=push.path, serial=serial,
                             sha256_manifest=push.sha256_manifest, pinned=push.pinned)
    versions.append(version)
    dropped: list[AdapterVersion] = []
    while len(versions) > state.max_versions_per_run:
        # The oldest unpinned version other than the one pushed.
        oldest = next((v for v in versions[:-1] if not v.pinned), None)
        if oldest is None:
            raise Conflict(f"run {push.run!r} keeps at most {state.max_versions_per_run} versions "
                           "(spec.adapters.maxVersionsPerRun) and every older one is pinned: unpin one first",
                           field="pinned")
        versions.remove(oldest)
        dropped.append(oldest)
    runs = {**state.runs, push.run: AdapterRun(versions=tuple(versions))}
    new = state.model_copy(update={"runs": runs, "serial": serial})
    if new.spec_bytes() > MAX_SPEC_BYTES:
        raise Conflict(f"run {push.run!r}: the pool's declared adapters would take {new.spec_bytes()} bytes, "
                       f"over {MAX_SPEC_BYTES}; lower spec.adapters.maxVersionsPerRun or remove runs",
                       field="spec.adapters")
    return PushDecision(state=new, version=version, dropped=tuple(dropped))


def adapters_patch(pool: dict[str, Any], decision: PushDecision, run: str) -> dict[str, Any]:
    """The merge patch a decided push writes: the run's whole version list and the serial counter,
    nothing of the other runs (a merge patch leaves the keys it does not name). It carries the
    resourceVersion the decision read: a pool changed in between refuses it (409), and the route
    reads and decides again."""
    meta = pool.get("metadata") or {}
    spec = decision.state.to_spec()
    return {"metadata": {"resourceVersion": meta.get("resourceVersion")},
            "spec": {"adapters": {"serial": spec["serial"], "runs": {run: spec["runs"][run]}}}}


def push_answer(push: AdapterPush, version: AdapterVersion) -> dict[str, Any]:
    """`POST /v1/pool/adapters`'s answer: how a client names the version from now on (`model` on the
    OpenAI routes, `model_path` for Tinker's sampling client) and its engine name. A repeat of the
    run's newest version answers the same (its declared version, not the request's copy)."""
    return {"run": push.run, "step": version.step, "version_label": version.label,
            "model": f"{push.run}@{version.step}",
            "model_path": f"{TINKER_PREFIX}{push.run}/{SAMPLER_WEIGHTS}/{version.label}",
            "engine_name": version.engine_name(push.run), "servable": push.servable}
