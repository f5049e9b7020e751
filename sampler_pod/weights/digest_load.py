"""A load that names its weights by their model digest (`sha256`): how a replica gets weights pushed over the
network when it was not the one finishing the push (docs/design/weights-over-network.md, phases D and E).

`POST /v1/checkpoints/load {"version_label", "sha256", "step"?, "in_flight"?, "kv"?, "peers"?, "path"?}`.
The weights come from the first of these that has them, and go through the same validate -> lock ->
intended -> write -> version path as any load (`WeightsService.write_copy`):

1. **the push this replica received and holds** with that digest, verified, not yet written: a pool's
   gateway declared the push in `spec.weights` instead of finishing it, and the operator's rollout sends
   each replica this load (its Drain, Abort or Keep; the pool's batches and routing switch);
2. **its own kept copy** of those weights (the last push or catch-up it wrote, kept in host memory);
3. **a peer** (`peers`, in order): a replica created, restarted or replaced after the push catches up from
   a ready replica serving the label (weights/peer_copy.py), every tensor checked against the served
   model and the copy's model digest against `sha256` before a byte is written; a peer that fails is
   skipped for the next;
4. **the checkpoint at `path`**, when the trainer has written a durable copy since: loaded as any
   checkpoint, its model digest checked against `sha256` first.

With none of them: 409 `weights_unavailable` naming `sha256` and saying what each source answered;
nothing was written and the replica stays as it is (a replica waiting for these weights stays unready,
with its reason: it never serves other weights under their label).
"""

from __future__ import annotations

import logging
import time

from sampler_common.errors import InvalidRequest

from ..core.sampler import SamplerCore
from .peer_copy import PeerCopyFailed, WeightsUnavailable, fetch
from .service import LoadCheckpointRequest, LoadCheckpointResponse, WeightsService
from .transfer import WeightTransferService

log = logging.getLogger(__name__)


class DigestLoads:
    def __init__(self, core: SamplerCore, weights: WeightsService, transfer: WeightTransferService) -> None:
        self.core, self.weights, self.transfer = core, weights, transfer

    async def load(self, req: LoadCheckpointRequest) -> LoadCheckpointResponse:
        if req.sha256 is None:
            if req.peers:
                raise InvalidRequest("peers needs sha256: a peer is asked for weights by their digest", field="peers")
            return await self.weights.load_checkpoint(req)
        if req.test_fail_after_tensors is not None:
            raise InvalidRequest("test_fail_after_tensors applies to a checkpoint load (path without sha256)",
                                 field="test_fail_after_tensors")
        core = self.core
        require = core.require_engine if core.awaiting_weights is not None else core.require_serving
        engine = require()
        req.check(engine)
        sha256 = req.sha256.lower()
        tried: list[str] = []

        held = await self.transfer.write_held(sha256, req.version_label, req)
        if held is not None:
            return held
        tried.append("no push of it received here")

        kept = await engine.kept()
        if kept is not None and kept.sha256 == sha256:
            t0 = time.monotonic()
            staged = await engine.stage_kept(sha256)
            return await self.weights.write_copy(engine, staged, sha256, req.version_label, req, validation_s=0.0,
                                                 stage_s=time.monotonic() - t0, total_bytes=kept.total_bytes,
                                                 source="kept")
        tried.append(f"its kept copy is of {kept.sha256}" if kept is not None else "no kept copy")

        deadline = time.monotonic() + (req.timeout_s or core.cfg.load_timeout_s)
        schema = self.weights.schema(field="sha256")
        for peer in req.peers or []:
            try:
                got = await fetch(engine, peer, sha256, schema, core.cfg.admin_api_key or core.cfg.api_key,
                                  keep=not core.cfg.drop_pushed_weights, deadline=deadline)
            except PeerCopyFailed as e:
                log.warning("catch-up of sha256 %s from %s failed: %s", sha256, peer, e)
                tried.append(f"peer {peer}: {e}")
                continue
            log.info("caught up sha256 %s (%d bytes) from %s in %.2fs", sha256, got.total_bytes, peer, got.seconds)
            return await self.weights.write_copy(engine, got.staged, sha256, req.version_label, req, validation_s=0.0,
                                                 stage_s=got.seconds, total_bytes=got.total_bytes,
                                                 source=f"peer {peer}")
        if not req.peers:
            tried.append("no peers named")

        if req.path is not None:
            return await self.weights.load_checkpoint(req)
        raise WeightsUnavailable(f"sha256: the weights of {sha256} ({req.version_label!r}) are nowhere to load from: "
                                 f"{'; '.join(tried)}; and no checkpoint `path` was named. Nothing was written.",
                                 field="sha256")
