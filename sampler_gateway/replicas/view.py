"""The replica set as the gateway sees it: pure data, produced by discovery, read by the picker.

Discovery (static flags or the API server) says which replicas exist, where and whether they are
draining; the replica's own `/health` says whether it is ready and which weights it serves. A
`ReplicaView` is both, as of one refresh.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sampler_common.adapters import AdapterState

from .adapter_health import ReplicaLora


@dataclass(frozen=True)
class Member:
    """What discovery knows before asking the replica: its name, its address, whether it drains."""

    name: str
    url: str
    draining: bool = False


@dataclass(frozen=True)
class EngineView:
    """What a replica's `/health` says of its engine, read by the endpoint scorer (routing/score.py):
    its prefix cache's block size in tokens (None: no prefix cache, or a sampler too old to say), its
    KV cache's blocks, the requests waiting in its engine and the fraction of KV blocks in use at its
    last step, and when its process started (a new value: a restart, its caches empty)."""

    block_size: int | None = None
    blocks: int | None = None
    queue: int = 0
    usage: float = 0.0
    started_at: str | None = None


@dataclass(frozen=True)
class ReplicaView:
    name: str
    url: str
    ready: bool
    draining: bool
    weights_label: str | None
    weights_version: int | None
    # Why it is not ready (its /health reason, or the error reaching it); None when ready.
    reason: str | None = None
    # /health reads in a row that got no answer (discovery/health.py).
    unanswered: int = 0
    # The training step of its weights, when its load named one (`weights_step` of /health).
    weights_step: int | None = None
    # The base model it serves (`model` of /health): a request may name it instead of an adapter.
    model: str | None = None
    # Its LoRA adapters and slots as its last /health said (adapter_health.py); the gateway's own
    # loads and unloads since are applied on top (lora/router.py).
    lora: ReplicaLora = field(default_factory=lambda: ReplicaLora(None))
    # Its engine's cache and queue as its last /health said.
    engine: EngineView = field(default_factory=EngineView)


@dataclass(frozen=True)
class PoolView:
    """One refresh of the whole pool. `target_label`/`min_label`: the pool's declared weights, when
    discovery knows them (the SamplerPool spec); the gateway's flags otherwise."""

    replicas: tuple[ReplicaView, ...] = ()
    target_label: str | None = None
    min_label: str | None = None
    # When this refresh started (time.monotonic): a replica marked lost after it stays out.
    started_at: float = 0.0
    by_name: dict[str, ReplicaView] = field(init=False, compare=False, repr=False)
    # Where each replica sits in `replicas` (by name): `replaced` finds the ones it replaces there.
    positions: dict[str, int] = field(init=False, compare=False, repr=False)
    # The pool's weights history (label, generation), when discovery reads a SamplerPool.
    history: tuple[tuple[str, int], ...] = ()
    # The pool's declared adapters (`spec.adapters`), when discovery knows them; None: none declared.
    adapters: AdapterState | None = None
    # The members (discovery's records) this view was merged from (discovery/merge.py): while the
    # next membership carries the very same tuple, only the replicas a read concerns can move, and
    # the next view is worked out for those alone. None: not from a merge.
    members: tuple[Member, ...] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "by_name", {r.name: r for r in self.replicas})
        object.__setattr__(self, "positions", {r.name: i for i, r in enumerate(self.replicas)})

    def replaced(self, moved: Mapping[str, ReplicaView], **fields: Any) -> PoolView:
        """This view with each replica named in `moved` (each one of its own) replaced in place, and
        `fields` changed: in proportion to `moved`, not to the pool. A read or a response concerns one
        replica, and the gateway publishes a view at each (issue #53: a rollout at 256 replicas
        behind 8 gateways). The order of the replicas is kept, so are `positions`."""
        replicas = list(self.replicas)
        for name, r in moved.items():
            replicas[self.positions[name]] = r
        out = object.__new__(PoolView)
        for f in dataclasses.fields(self):
            object.__setattr__(out, f.name, fields[f.name] if f.name in fields else getattr(self, f.name))
        object.__setattr__(out, "replicas", tuple(replicas))
        object.__setattr__(out, "by_name", {**self.by_name, **moved})
        return out
