"""Startup restore: a starting replica loads the weights it must serve before it reports ready.

What it must serve: the state file (`--weights-state-path`, see `state_file.py`) if it holds a
readable record, else the `--initial-*` flags, else the base model. The checkpoint goes through
the same validation and write path as `POST /v1/checkpoints/load`
(`WeightsService.load_checkpoint`), then the adapters through `add_adapter`. Until that is done
`/health` says `starting` (reason: `loading initial weights <label>`), `/readyz` is 503 and
samples get 503: the replica never serves the base model when it was told otherwise.

Outcomes:
- an initial checkpoint that cannot be loaded (gone, refused by validation, its validation timed
  out) leaves the replica up and unready: `starting`, reason `intended checkpoint unavailable: PATH
  (why)`, samples 503, the base model never served. It does NOT exit: on a pod the state file
  lives on the emptyDir and a replacement pod gets the same path from the operator, so an exit
  would only come back to the same missing files (a crash loop, issue #23). The start-up counts as
  finished (`/startedz`, `--startup-timeout-s`), and a later validated `POST /v1/checkpoints/load`
  (the operator sends spec.weights, or a pool's target) loads other weights and makes it ready;
- an initial adapter that fails validation (or any other failure before a write) is a startup
  error: `engine_dead` naming the file or tensor, and the server stops (exit 1);
- a write that fails midway is the ordinary uncertain path (`uncertain_weights`, the process
  stays up for the operator to read `failed_write` and replace the pod).

Why here and not in `core/startup.py`: the restore needs `WeightsService`, which sits in a layer
above `core` (imports only point down, `tests/unit/test_layers.py`). So this wraps core's engine
starter, and `__main__` hands the wrapped starter to `create_app`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from sampler_common.errors import LoadTimedOut, SamplerError

from ..config import ServerConfig
from ..core.health import intended_unavailable_reason
from ..core.sampler import SamplerCore
from ..core.startup import EngineStarter
from .service import AddAdapterRequest, LoadCheckpointRequest, WeightsService, WeightWriteFailed
from .state_file import PersistedAdapter, PersistedWeights, read_state
from .transfer import prepare_landing
from .validation import CheckpointInvalid

log = logging.getLogger(__name__)


def intended_at_startup(cfg: ServerConfig) -> PersistedWeights | None:
    """The weights this replica must come up with: the state file wins over the flags (it is newer:
    it records loads sent straight to this pod). None: the base model, no adapters."""
    state = read_state(cfg.weights_state_path)
    if state is not None:
        log.info("weights state file %s: restoring checkpoint %s (%s), adapters %s", cfg.weights_state_path,
                 state.version_label, state.checkpoint, [a.name for a in state.adapters])
        return None if state.empty else state
    if cfg.initial_version_label is None and not cfg.initial_adapters:
        return None
    return PersistedWeights(checkpoint=cfg.initial_checkpoint, version_label=cfg.initial_version_label,
                            sha256_manifest=cfg.initial_sha256_manifest, step=cfg.initial_step,
                            sha256=cfg.initial_sha256.lower() if cfg.initial_sha256 else None,
                            adapters=[PersistedAdapter(name=a.name, path=a.path) for a in cfg.initial_adapters or []])


def _what(target: PersistedWeights) -> str:
    return f"initial weights {target.version_label}" if target.version_label else "initial adapters"


class CheckpointUnavailable(Exception):
    """The intended checkpoint could not be loaded before any weight was written."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


async def restore(service: WeightsService, target: PersistedWeights) -> None:
    """Load `target` into a started engine (the core is `restoring`), then record it in the state file.
    Raises `CheckpointUnavailable` when the checkpoint cannot be loaded (nothing was written)."""
    core = service.core
    if target.pushed:
        # No durable copy here: a peer has them (the operator sends a load naming the pool's ready replicas,
        # weights/digest_load.py), or a checkpoint written since. Waiting, unready, beats serving other
        # weights under their label.
        raise CheckpointUnavailable(intended_unavailable_reason(
            f"network push {target.version_label} (sha256 {target.sha256})",
            "weights pushed over the network have no durable copy here; waiting for a load that names a peer "
            "holding them (the operator sends one) or a checkpoint"))
    if target.checkpoint is not None and target.version_label is not None:
        core.restoring = f"loading initial weights {target.version_label}"
        try:
            await service.load_checkpoint(
                LoadCheckpointRequest(path=target.checkpoint, version_label=target.version_label,
                                      sha256_manifest=target.sha256_manifest, step=target.step,
                                      sha256=target.sha256), restoring=True)
        except (CheckpointInvalid, LoadTimedOut) as e:
            # Only what says "these files cannot be loaded": an engine failure stays fatal below.
            raise CheckpointUnavailable(intended_unavailable_reason(target.checkpoint, e.message)) from e
    for a in target.adapters:
        core.restoring = f"loading initial adapter {a.name}"
        await service.add_adapter(AddAdapterRequest(name=a.name, path=a.path), restoring=True)
    # Once, complete: a file rewritten after the checkpoint alone would forget the adapters if the
    # container died before they were back.
    await asyncio.to_thread(service.persist_state)


async def _prepare_landing(service: WeightsService) -> None:
    """A replica that takes network weights holds the block the next one lands in from its engine's start:
    a replacement's first load is a catch-up from a peer, which then lands in memory touched meanwhile
    (about 0.1 CPU-s per 340 MB in the background, against page faults inside the copy)."""
    core = service.core
    receiver = core.engine.weight_receiver if core.engine is not None else None
    if receiver is None:
        return
    try:
        await prepare_landing(core, service, receiver)
    except Exception:  # only memory touched ahead of time: a push or catch-up lands in new memory without it
        log.exception("could not prepare the block where network weights land; they will land in new memory")


def with_initial_weights(cfg: ServerConfig, service: WeightsService, start_engine: EngineStarter,
                         on_fatal: Callable[[], None]) -> EngineStarter:
    """`start_engine`, then the restore of the intended weights, before the replica reports ready."""

    async def start(core: SamplerCore) -> None:
        target = await asyncio.to_thread(intended_at_startup, cfg)
        if target is not None:
            # Set before the engine exists, so no /health read between "engine up" and "restore
            # started" can ever see `ok` on the base weights.
            core.restoring = f"loading {_what(target)}"
        try:
            await start_engine(core)
            if core.engine is not None and core.startup_error is None:
                await _prepare_landing(service)
            if target is None or core.engine is None or core.startup_error is not None:
                return  # nothing to restore, or engine startup failed (already recorded, on_fatal called)
            await restore(service, target)
            log.info("restored %s", _what(target))
        except asyncio.CancelledError:
            raise
        except CheckpointUnavailable as e:
            # Up and unready, never the base model, no exit (see the module docstring). The adapters
            # wait too: they are loaded over a base checkpoint this replica does not have.
            core.awaiting_weights = e.reason
            log.error("%s; waiting for a checkpoint load (the operator sends spec.weights or the pool's target)",
                      e.reason)
        except WeightWriteFailed:
            # `_write` recorded `uncertain_weights` and `failed_write`; the process stays up so the
            # operator reads them and replaces the pod.
            log.error("the initial weights write failed midway; the replica must be replaced")
        except Exception as e:
            what = _what(target) if target is not None else "startup"
            detail = e.message if isinstance(e, SamplerError) else f"{type(e).__name__}: {e}"
            core.startup_error = f"{what} could not be loaded: {detail}"
            log.error("%s", core.startup_error)
            on_fatal()
        finally:
            core.restoring = None

    return start
