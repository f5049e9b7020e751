"""A new request for one adapter version through the gateway: `forward.to_new`'s life, placed by
adapter (lora/router.py) instead of the picker.

The client's name (`<run>`, `<run>@<step>`, a tinker:// path) was resolved to one version; the
replica is sent the version's ENGINE name (`<run>.<step>.<serial>`) in its place (`rewrite`), so it
samples exactly that version, and it answers "unknown adapter" rather than ever sample the base model
for it. The reasons to send a request once more, each at most once:
- a replica that never got it (refused connection), as for any new work;
- a replica lost while running it, for a sync sample that may be re-run (`rerun`) or a submit;
- the replica no longer holds the version (it was unloaded since: its 4xx naming the field): placed
  again, loaded again;
- under the pool's `Latest` policy, a `<run>` answer older than one already returned for that run
  (`RunOrder`): re-resolved and run again on the newest version; a second such answer is a 503 the
  client retries ("resubmit"). A pinned version's answers are always returned.
The full weights' version policy judges every answer as for any new work (`Pool.returned`).
Before the send, placing it (its slot, its load) is the router's: a replica that fails a load or an
unload leaves placement and the request is placed again, as often as its bound allows
(lora/router.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from ..errors import NoReplica
from ..lora.names import VersionTarget
from ..lora.router import unknown_adapter
from ..replicas.view import ReplicaView
from ..routing.score import Prompt
from ..upstream.exchange import Lost, NotStarted, Outgoing, Reply, TimedOut
from .forward import Gateway, LabelOf, SecondChances, _discard, _open, after_failed_send, returnable, with_retried


async def to_version(gw: Gateway, name: str, fieldname: str, target: VersionTarget,
                     rewrite: Callable[[str], Outgoing], *, resendable: bool = False, rerun: bool = False,
                     label_of: LabelOf | None = None, stream: bool = False, flow: str = "base", cost: int = 1,
                     wait_s: float | None = None, prompt: Prompt | None = None
                     ) -> tuple[ReplicaView, Reply, VersionTarget]:
    """Place, load if needed, send `rewrite(engine name)`, judge the answer (module docstring).
    Returns the replica, its answer and the version that answered. `stream`: an event stream is
    returned at its head (as `to_new`); the version stays counted in flight until it is closed.
    `flow`, `cost`, `wait_s`: its turn and bound when it waits for a LoRA slot (lora/router.py).
    `prompt`: what the endpoint scorer reads of it, scoped by the version placed (its decision is set
    on the prompt of the last placement: `Prompt.for_adapter`, returned through `prompt.decision`)."""
    router = gw.adapters
    tried: set[str] = set()
    label: str | None = None
    lost: str | None = None
    used = SecondChances()
    placed_again = False
    while True:
        scoped = prompt.for_adapter(target.engine_name) if prompt is not None else None
        replica, key = await router.acquire(target, frozenset(tried), label, flow=flow, cost=cost, wait_s=wait_s,
                                            prompt=scoped)
        if prompt is not None and scoped is not None:
            prompt.decision = scoped.decision
        held = False  # the version's count is the open stream's, released when it closes
        try:
            if stream:
                reply = await _open(gw, replica, rewrite(target.engine_name), scoped)
                if reply.stream is not None:
                    reply.stream.on_close(functools.partial(router.release, key))
                    held = True
            else:
                with gw.pool.lease(replica, "new", scoped):
                    reply = await gw.upstream.send(replica, rewrite(target.engine_name))
        except (NotStarted, Lost, TimedOut) as e:
            tried.add(replica.name)
            retry = after_failed_send(gw, replica, e, used, resendable, rerun)
            label, lost = retry.label, retry.lost or lost
            continue
        finally:
            if not held:
                router.release(key)
        if unknown_adapter(reply, fieldname):
            router.forget(replica.name, target.engine_name)
            if not placed_again:
                placed_again = True
                gw.metrics.adapter_replaced.labels(replica=replica.name).inc()
                continue
            # Twice: the replica's own answer (a 4xx naming the field), never the base model.
            return replica, reply, target
        if not await returnable(gw, replica, reply, label_of, used):
            label = None
            continue
        if reply.status == 200 and not resendable:
            if router.order.is_stale(target, gw.cfg.version_policy, router.state):
                _discard(reply)
                gw.metrics.stale.labels(replica=replica.name).inc()
                newest = router.order.newest_returned.get(target.run)
                if not used.stale:
                    used.stale = True
                    again = router.resolve(name, fieldname)
                    if isinstance(again, VersionTarget):
                        target = again
                    continue
                raise NoReplica(f"{fieldname} {name!r}: the answer ran on step {target.version.step} of run "
                                f"{target.run!r}, older than step {newest} already returned; resubmit",
                                gw.cfg.retry_after_s)
            router.order.returned(target)
        return replica, with_retried(reply, lost), target

