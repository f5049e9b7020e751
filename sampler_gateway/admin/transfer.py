"""A push over the network through the pool's gateway, carried out: the trainer's single control plane
(docs/design/weights-over-network.md, phase B). vLLM's control calls arrive here, at vLLM's paths with
vLLM's bodies (routes/weight_transfer.py), and each goes to every member of the push with its own rank
offset (`transfer_plan.py` decides who and how). So a script written against vLLM's trainer API, or
`sampler_client`'s `Pool.push_weights`, pushes into the whole pool with one call.

The calls, and what the pool does with them:

* **init** joins the pool's usable replicas (the members: ready, not draining, not seen failing, whatever
  weights they serve) into the trainer's one world, concurrently (the group forms only once every rank
  has joined); answered once all joined. Members are not the replicas the version policy routes to now:
  a replica that missed a push serves an older label, Latest routes nothing to it, and only a push that
  reaches it brings it back (without an operator, nothing else would).
* **start** opens the round on every member.
* **update** sends the update info to every member; each checks the tensors against its model before a
  byte moves, receives, and verifies every tensor's digest; answered once every member has received and
  verified its bytes, with the model digest they agree on. **Nothing is written yet.**
* **finish** declares the push. With a SamplerPool (kube discovery) it writes `spec.weights = {versionLabel,
  step, sha256}` (no checkpoint) through the same pool-object path as a disk push (`POST /v1/pool/weights`),
  and answers once the rollout is complete: the operator's rollout (Drain, Abort or Keep, maxUnavailable,
  the routing switch, one order of labels across gateways) sends each replica a load naming the digest,
  and each writes the push it holds (sampler_pod/weights/digest_load.py); a replica that missed the push
  (starting, replaced) catches up from a peer that wrote it. Without one (static discovery, no operator)
  the gateway sends each member the finish itself, all at once, each writing in the update's
  `in_flight` mode: the equivalent of a disk push there, which a static gateway does not have.
* **shutdown** has every member leave the group.

**A member that fails mid-transfer** (killed, a timeout, a refusal): the push ends at its first failure,
answered at once naming it (502 `replica_lost`, 504 `replica_timeout`, or the replica's own answer).
Nothing was written anywhere (a write starts only at finish, after every member verified its bytes), so
**all replicas stay** at their weights: none is uncertain, the pool never serves two labels because of a
tear. The other members' calls end by themselves once the trainer's group closes (the trainer drops it on
the error) or after the init's `timeout_s`; until they have, a new init waits for them (up to that bound),
then joins everyone afresh: a retry works.

**One push at a time.** The push is in one phase at a time (`PoolSession`): a second trainer's init while a
push moves (joining, receiving, writing) is a 409, and so is a call out of order. The session lives in
this gateway: with several gateway pods, a trainer must reach the same one for a push's calls (one
connection, as `sampler_client` keeps); a call that lands on another is a 409 naming it, and the trainer
starts over from init (sampler_client does by itself).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sampler_common.errors import Conflict, SamplerError, validation_error

from ..errors import ReplicaLost, ReplicaRefused, ReplicaTimeout, RolloutStopped, RolloutTimedOut
from ..forwarding.forward import Gateway
from ..replicas.view import ReplicaView
from .adapters import Replicas
from .pool_object import PoolObject, write_checked
from .transfer_plan import (
    Member,
    PoolSession,
    changed_members,
    default_label,
    init_info_of,
    members,
    received_by_all,
    replica_init,
    update_info_of,
    workers_of,
    world_size,
)
from .weights import MAX_WAIT_S, WeightsPush, rollout_of, weights_patch

log = logging.getLogger(__name__)

# The trainer's world fails a join after this when init_info names no timeout_s (gloo's default, 60 s).
DEFAULT_JOIN_TIMEOUT_S = 60.0
# How many times the declaration re-reads the pool when the operator's status writes moved it under the
# write (as a disk push does, routes/pool.py).
WRITE_ATTEMPTS = 5
NOTHING_WRITTEN = ("; nothing was written on any replica: every replica stays at the weights it served (the "
                   "push is over; push again from init_weight_transfer_engine)")


class FinishBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    weight_version: str | None = Field(None, min_length=1, max_length=200)


def _noted(e: SamplerError, note: str) -> SamplerError:
    e.message += note
    return e


class PoolTransfer:
    def __init__(self, gw: Gateway, pool_object: PoolObject | None) -> None:
        self.gw, self.obj = gw, pool_object
        self.replicas = Replicas(gw)
        self.session = PoolSession()
        # One change of phase at a time; the long phases are phases, so a call meanwhile is a 409.
        self._calls = asyncio.Lock()
        # Calls to replicas still running after their push ended at another member's failure, by replica.
        self._outstanding: dict[asyncio.Future[Any], str] = {}
        self._join_timeout_s = DEFAULT_JOIN_TIMEOUT_S

    # ------------------------------------------------------------ the replicas

    def _view(self, m: Member) -> ReplicaView:
        return ReplicaView(m.name, m.url, ready=True, draining=False, weights_label=None, weights_version=None)

    async def _call(self, m: Member, method: str, path: str, body: dict[str, Any] | None,
                    timeout_s: float) -> dict[str, Any]:
        reply = await self.replicas.send(self._view(m), method, path, body, timeout_s=timeout_s)
        answer = reply.json or {}
        if reply.status >= 400:
            raw = answer.get("error")
            error: dict[str, Any] = raw if isinstance(raw, dict) else {}
            raise ReplicaRefused(m.name, reply.status, {**error, "message": error.get("message") or
                                                        reply.body[:300].decode(errors="replace")})
        return answer

    async def _fan(self, of: Iterable[Member], call: Callable[[Member], Awaitable[dict[str, Any]]], *,
                   wait_all: bool = False) -> tuple[dict[str, dict[str, Any]], dict[str, SamplerError]]:
        """`call` on every member at once. Without `wait_all`, the first failure is raised at once (the
        others go on, tracked in `_outstanding` until they end); with it, every answer and failure."""
        tasks: dict[asyncio.Future[dict[str, Any]], str] = {}
        for m in of:
            task: asyncio.Future[dict[str, Any]] = asyncio.ensure_future(call(m))
            tasks[task] = m.name
            self._outstanding[task] = m.name
            task.add_done_callback(lambda t: self._outstanding.pop(t, None))
            task.add_done_callback(_retrieved)
        answers: dict[str, dict[str, Any]] = {}
        failures: dict[str, SamplerError] = {}
        pending = set(tasks)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=tasks.__getitem__):
                error = task.exception()
                if error is None:
                    answers[tasks[task]] = task.result()
                    continue
                if not isinstance(error, SamplerError):
                    error = SamplerError(f"replica {tasks[task]}: {type(error).__name__}: {error}")
                if not wait_all:
                    raise error
                failures[tasks[task]] = error
        return answers, failures

    async def _settled(self) -> None:
        """The calls of a push that ended early have ended (bounded: each ends within the join's timeout
        once the trainer's group is gone), else a 409 naming the replicas still busy."""
        if not self._outstanding:
            return
        await asyncio.wait(set(self._outstanding), timeout=self._join_timeout_s + self.gw.cfg.upstream_grace_s)
        if self._outstanding:
            raise Conflict("init_weight_transfer_engine: the replicas of the last push are still ending it; push "
                           "again in a moment", field="init_weight_transfer_engine")

    async def _usable(self) -> dict[str, ReplicaView]:
        """The members a push would have now (see the module docstring); none: wait for one as a
        request does, then 503 naming why."""
        if not self.gw.pool.usable():
            await self.gw.pool.choose_within(self.gw.cfg.no_replica_wait_s)
        return {r.name: r for r in self.gw.pool.usable()}

    async def _routed(self) -> dict[str, tuple[str, int]]:
        """The members a push would have now, with their ranks: {name: (url, workers)}."""
        usable = await self._usable()
        timeout = self.gw.cfg.control_timeout_s
        answers, _ = await self._fan(
            (Member(r.name, r.url, 0, 0) for r in usable.values()),
            lambda m: self._call(m, "GET", "/get_world_size", None, timeout))
        return {name: (usable[name].url, workers_of(name, answers[name])) for name in answers}

    # ------------------------------------------------------------ the calls

    async def world_size(self) -> dict[str, Any]:
        routed = await self._routed()
        return {"world_size": sum(n for _, n in routed.values()),
                "replicas": {name: n for name, (_, n) in sorted(routed.items())}}

    async def init(self, body: Any) -> dict[str, Any]:
        async with self._calls:
            self.session.require("init_weight_transfer_engine")
            await self._settled()
            ms = members(await self._routed())
            info = init_info_of(body, ms)
            self.session.enter("joining")
            self.session.members = ms
        timeout = float(info.get("timeout_s") or DEFAULT_JOIN_TIMEOUT_S)
        self._join_timeout_s = timeout
        try:
            await self._fan(ms, lambda m: self._call(m, "POST", "/init_weight_transfer_engine", replica_init(info, m),
                                                     timeout + self.gw.cfg.upstream_grace_s))
        except SamplerError as e:
            self.session.end(f"init_weight_transfer_engine failed: {e.message}")
            raise _noted(e, "; the push's replicas leave the group (push again from init_weight_transfer_engine)") \
                from None
        self.session.enter("joined")
        log.info("weight transfer: joined %s (world %d)", ", ".join(f"{m.name}@{m.rank_offset}" for m in ms),
                 world_size(ms))
        return {"message": "Weight transfer initialized", "phase": "joined", "world_size": world_size(ms),
                "replicas": [{"name": m.name, "rank_offset": m.rank_offset, "workers": m.workers} for m in ms]}

    async def start(self) -> dict[str, Any]:
        async with self._calls:
            self.session.require("start_weight_update")
            ms = self.session.members
            # Every round goes to the usable replicas now: a group made before one came (or left) ends,
            # and the trainer joins the pool as it is (sampler_client does by itself, on this 409).
            routed = set(await self._usable())
            changed = changed_members(ms, routed)
            if changed is not None:
                self.session.end(f"the pool's usable replicas changed ({changed})")
                raise Conflict(f"start_weight_update: the pool's usable replicas changed since the trainer joined "
                               f"({changed}): push again from init_weight_transfer_engine (after /get_world_size)",
                               field="start_weight_update")
            try:
                await self._fan(ms, lambda m: self._call(m, "POST", "/start_weight_update", None,
                                                         self.gw.cfg.control_timeout_s))
            except SamplerError as e:
                # A member no longer in the group (it restarted): the trainer joins everyone again.
                self.session.end(f"start_weight_update failed: {e.message}")
                raise _noted(e, "; push again from init_weight_transfer_engine") from None
            self.session.enter("started")
        return {"message": "Weight update started", "phase": "started"}

    async def update(self, body: Any) -> dict[str, Any]:
        rollout = await self._rollout_mode()
        async with self._calls:
            self.session.require("update_weights")
            try:
                info = update_info_of(body, rollout)
            except SamplerError:
                # The trainer is already sending: its group is given up, as a replica gives up a refused push.
                self.session.end("update_weights refused by the gateway")
                raise
            self.session.enter("receiving")
            self.session.update = info
            ms = self.session.members
        try:
            answers, _ = await self._fan(ms, lambda m: self._call(m, "POST", "/update_weights", {"update_info": info},
                                                                  self.gw.cfg.transfer_timeout_s))
            received = received_by_all(answers)
        except SamplerError as e:
            e = await self._culprit(e, ms)
            self.session.end(f"update_weights failed: {e.message}")
            log.warning("weight transfer: the push tore: %s", e.message)
            raise _noted(e, NOTHING_WRITTEN) from None
        self.session.enter("received")
        self.session.received = received
        log.info("weight transfer: %d replicas received %d bytes (sha256 %s)", len(ms), received.total_bytes,
                 received.sha256)
        return {"message": "Weights updated", "phase": "received", "tensors": received.tensors,
                "total_bytes": received.total_bytes, "sha256": received.sha256, "receive_s": received.receive_s,
                "replicas": [m.name for m in ms]}

    async def finish(self, body: Any) -> dict[str, Any]:
        try:
            req = FinishBody.model_validate(body if body is not None else {})
        except ValidationError as e:
            raise validation_error(e) from None
        async with self._calls:
            self.session.require("finish_weight_update")
            received = self.session.received
            assert received is not None  # phase `received` has it
            label = req.weight_version or default_label(received.sha256)
            step = self.session.update.get("step")
            ms = self.session.members
            self.session.enter("writing")
        try:
            if self.obj is not None:
                return await self._declare(self.obj, label, step, received.sha256)
            return await self._write_each(ms, label)
        finally:
            self.session.enter("joined")
            self.session.received = None

    async def shutdown(self) -> dict[str, Any]:
        async with self._calls:
            self.session.require("shutdown_weight_transfer_engine")
            ms = self.session.members
            self.session.end("shut down by the trainer")
            self.session.ended = None
            _, failures = await self._fan(ms, lambda m: self._call(m, "POST", "/shutdown_weight_transfer_engine",
                                                                   None, self.gw.cfg.control_timeout_s),
                                          wait_all=True)
        for name, e in failures.items():  # it left anyway: its next push joins afresh
            log.warning("weight transfer: %s did not shut down cleanly: %s", name, e.message)
        return {"message": "Weight transfer shut down", "phase": "idle"}

    async def _culprit(self, first: SamplerError, ms: tuple[Member, ...]) -> SamplerError:
        """The failure to name when a push ended. A member whose receive TORE (its group closed under it) is
        a symptom: the trainer dropped the group because another member stopped taking bytes. So when the
        first failure is a tear and members have not answered yet, each is asked its `/health` (the
        control calls' bound): one that does not answer is named instead, a 504 saying so (a hung replica;
        a killed one answers its call at once, `replica_lost`)."""
        if not (isinstance(first, ReplicaRefused) and first.category == "transfer_failed"):
            return first
        pending = sorted(set(self._outstanding.values()) & {m.name for m in ms})
        if not pending:
            return first
        by_name = {m.name: m for m in ms}

        async def silent(name: str) -> bool:
            try:
                await self._call(by_name[name], "GET", "/health", None, self.gw.cfg.control_timeout_s)
            except (ReplicaLost, ReplicaTimeout):
                return True
            except SamplerError:  # it answered (not ok is an answer)
                return False
            return False

        hung = [n for n, quiet in zip(pending, await asyncio.gather(*(silent(n) for n in pending)), strict=True)
                if quiet]
        if not hung:
            return first
        return ReplicaTimeout(f"replica {hung[0]} stopped taking the push (no answer to its update nor to /health "
                              f"within {self.gw.cfg.control_timeout_s:g}s), so the trainer's group tore: "
                              f"{first.message}", field="update_info", headers={"X-Sampler-Replica": hung[0]})

    # ------------------------------------------------------------ the write

    async def _rollout_mode(self) -> tuple[str, str] | None:
        """The pool's (rollout.mode, rollout.kv) when it writes the weights; None without a pool object."""
        if self.obj is None:
            return None
        spec = (await self.obj.read()).get("spec") or {}
        rollout = spec.get("rollout") or {}
        return str(rollout.get("mode") or "Drain"), str(rollout.get("kv") or "Keep")

    async def _write_each(self, ms: tuple[Member, ...], label: str) -> dict[str, Any]:
        """No pool object (static discovery): every member writes the push it holds, at once."""
        answers, failures = await self._fan(
            ms, lambda m: self._call(m, "POST", "/finish_weight_update", {"weight_version": label},
                                     self.gw.cfg.transfer_timeout_s), wait_all=True)
        if failures:
            name = sorted(failures)[0]
            written = sorted(answers)
            raise _noted(failures[name], f"; the replicas that wrote {label!r}: {written or 'none'} (the others serve "
                                         "what they served, unless their own answer says the write failed midway)")
        first = answers[ms[0].name]
        return {"message": "Weight update finished", "weights_label": label, "weights_step": first.get("weights_step"),
                "weights_sha256": first.get("weights_sha256"), "replicas": answers}

    async def _declare(self, obj: PoolObject, label: str, step: Any, sha256: str) -> dict[str, Any]:
        """The push as the pool's weights (`spec.weights`), then the wait for the rollout (as `push --wait`)."""
        push = WeightsPush(version_label=label, step=step if isinstance(step, int) else None, sha256=sha256)
        pool = await write_checked(obj, lambda current: weights_patch(current, push), WRITE_ATTEMPTS)
        generation = (pool.get("metadata") or {}).get("generation")
        log.info("weight transfer: declared %s (sha256 %s) at generation %s", label, sha256, generation)
        deadline = time.monotonic() + self.gw.cfg.transfer_timeout_s
        while True:
            rollout = rollout_of(pool)
            observed = rollout["observed_generation"]
            seen = not isinstance(generation, int) or (isinstance(observed, int) and observed >= generation)
            if rollout["target_label"] != label:
                raise Conflict(f"weight_version: the pool's weights were changed to {rollout['target_label']!r} while "
                               f"{label!r} rolled out (another push)", field="weight_version")
            if seen and rollout["state"] == "Complete":
                return {"message": "Weight update finished", "weights_label": label, "weights_step": push.step,
                        "weights_sha256": sha256, "rollout": rollout}
            if seen and rollout["state"] == "Stopped":
                raise RolloutStopped(f"the rollout of {label!r} stopped at replica {rollout['stopped_replica']}: "
                                     f"{rollout['message']}; the pool serves what it served", field="weight_version")
            left = deadline - time.monotonic()
            if left <= 0:
                where = ", ".join(f"{r['name']}: {r['state']}" for r in rollout["replicas"])
                raise RolloutTimedOut(f"the rollout of {label!r} did not complete within --transfer-timeout-s="
                                      f"{self.gw.cfg.transfer_timeout_s:g}s ({where}); it goes on",
                                      field="weight_version")
            version = (pool.get("metadata") or {}).get("resourceVersion")
            changed = await obj.changed(version, min(MAX_WAIT_S, left)) if isinstance(version, str) else None
            pool = changed or await obj.read()

    def report(self) -> dict[str, Any]:
        return self.session.report()


def _retrieved(task: asyncio.Future[Any]) -> None:
    """A replica's call whose answer nobody waits for any more (its push ended at another's failure) is read,
    never logged as lost."""
    if not task.cancelled():
        with contextlib.suppress(BaseException):
            task.exception()
