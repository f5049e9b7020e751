"""The gateway's live state: the latest view of the replicas, its own in-flight counts (requests, and
the sequences and tokens of new work), the label order, which replicas it saw fail since their last
health check, and which prompt prefixes it sent where (`prefix.PrefixIndex`, `prefix.BurstWindow`).
Routes ask it for a replica; it calls the pure decisions (`versions.version_filter`, then
`score.decide`, or `picker.pick` under `--picker least-loaded`) and keeps the metrics.

All of it lives in one event loop (uvicorn's), so plain dicts and ints need no locks.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from sampler_common.adapters import AdapterState, adapter_state
from sampler_common.errors import Conflict
from sampler_common.rollout_trace import trace

from ..config import GatewayConfig
from ..errors import NoReplica
from ..metrics.registry import GatewayMetrics
from ..replicas.adapter_health import ReplicaLora
from ..replicas.view import EngineView, PoolView, ReplicaView
from .picker import pick, preferred
from .prefix import BurstWindow, PrefixIndex
from .score import Decision, Prompt, Weights, decide, load_cost, terms_of
from .switch import Switch
from .versions import LabelOrder, is_stale, rank, version_filter

log = logging.getLogger(__name__)


class Pool:
    def __init__(self, cfg: GatewayConfig, metrics: GatewayMetrics,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg, self.metrics, self.clock = cfg, metrics, clock
        self.view = PoolView()
        self.order = LabelOrder()
        self.in_flight: dict[str, int] = {}
        # New work's sequences and tokens in flight per replica, and each replica's load cost from them and
        # its last /health (score.load_cost), kept up to date here so a pick reads it, never computes it.
        self.seqs: dict[str, int] = {}
        self.tokens: dict[str, int] = {}
        self._load: dict[str, float] = {}
        self.weights = Weights(prefix=cfg.score_prefix_weight, load=cfg.score_load_weight,
                               tokens=cfg.score_tokens_weight, queue=cfg.score_queue_weight, kv=cfg.score_kv_weight,
                               imbalance=cfg.score_imbalance, imbalance_ratio=cfg.score_imbalance_ratio)
        # Which prompt blocks went to which replica, and where each recent whole prompt went.
        self.index = PrefixIndex(cfg.prefix_index_blocks)
        self.bursts = BurstWindow(cfg.burst_window_s)
        self._block_sizes: tuple[int, ...] = ()
        # The last eligible list scored and where each replica sits in it: a pool's eligible replicas
        # rarely change between two requests, and finding them anew would be a Python loop per pick.
        self._scored: list[ReplicaView] = []
        # `candidates` and the version policy's filter of them, kept until what they read changes.
        self._cands: list[ReplicaView] = []
        self._cands_view: PoolView | None = None
        self._cands_key: tuple[int, frozenset[str] | None] = (-1, None)
        self._filtered: tuple[list[ReplicaView], list[ReplicaView]] = ([], [])
        self._filtered_from: list[ReplicaView] | None = None
        self._filtered_key: tuple[object, ...] = ()
        self._names: list[str] = []
        self._positions: dict[str, int] = {}
        metrics.index_blocks.set_function(self.index.size)
        for state in ("ready", "draining", "not_ready"):
            metrics.replicas.labels(state=state).set_function(functools.partial(self._count_state, state))
        # Replica -> (when, why) the gateway saw it fail; it stays out until a refresh that started
        # later finds it ready again (a failed connection is fresher news than the last /health).
        self._lost: dict[str, tuple[float, str]] = {}
        self._lost_changes = 0
        self._turn = itertools.count()
        self._changed = asyncio.Event()
        # Replica -> when it last answered a request (passive health: a busy replica's late /health
        # does not count against it, discovery/health.py).
        self._answered_at: dict[str, float] = {}
        self.refreshes = 0
        # The pool's routing switch (routing/switch.py), with kube discovery: which labels may be returned
        # and routed to now. None: no switch (static discovery).
        self.switch: Switch | None = None
        # Called when the declared adapters this gateway routes by move on (its routing Lease says
        # which it routes by: routing/switch.py, adapter_acks.py).
        self.on_adapters: Callable[[], None] | None = None
        # Called at each change that decides routing: the fair gate's room may have grown (admission/gate.py).
        self.on_room: Callable[[], None] | None = None
        self.who = f"gateway/{cfg.pod_name or 'gateway'}"  # in the rollout trace

    # ---------------------------------------------------------------- what the policy reads

    @property
    def target(self) -> str | None:
        return self.view.target_label or self.cfg.target_label

    @property
    def min_label(self) -> str | None:
        return self.view.min_label or self.cfg.min_label

    def update(self, view: PoolView, refreshed: bool = True) -> None:
        """A view from discovery: a refresh's `/health` reads, or (`refreshed=False`) a membership
        change applied to the last reads (discovery/merge.py)."""
        for name, (at, _) in list(self._lost.items()):
            r = view.by_name.get(name)
            if r is None or (r.ready and view.started_at > at):
                del self._lost[name]
                self._lost_changes += 1
        view = self._newest_adapters(view)
        moved = _serial(view.adapters) != _serial(self.view.adapters)
        changed = self._track(self.view, view)
        self.view = view
        if moved and self.on_adapters is not None:
            self.on_adapters()
        self.order.set_history(dict(view.history))
        # The labels and steps of the replicas whose view moved: the others' were seen when they did.
        self.order.see(((r.weights_label, r.weights_version) for r in changed
                        if r.ready and r.weights_label is not None),
                       {r.weights_label: r.weights_step for r in changed
                        if r.weights_label is not None and r.weights_step is not None})
        if refreshed:
            self.refreshes += 1
        self._notify()

    def _count_state(self, state: str) -> int:
        """The replicas in `state` now (the `replicas` gauge, counted when scraped, not at each update)."""
        n = 0
        for r in self.view.replicas:
            n += ("draining" if r.draining else "ready" if self._usable(r) else "not_ready") == state
        return n

    def _track(self, old: PoolView, new: PoolView) -> list[ReplicaView]:
        """The prefix index forgets each replica that left, moved, restarted or changed its weights (its
        prefix cache is gone); the load cost follows each changed /health read. Returns the views of
        `new` that are not in `old` (by identity): the work is theirs alone (`moves`), so a read of one
        replica costs one replica's work, not the pool's."""
        pairs = moves(old, new)
        if pairs is None:  # members came or went: the whole pool
            for r in old.replicas:
                now = new.by_name.get(r.name)
                if now is not r and (now is None or cache_reset(r, now)):
                    self.index.forget(r.name)
                    self.bursts.forget(r.name)
            changed = [r for r in new.replicas if old.by_name.get(r.name) is not r or r.name not in self._load]
            for name in [n for n in self._load if n not in new.by_name]:
                del self._load[name]
        else:
            for before, now in pairs:
                if cache_reset(before, now):
                    self.index.forget(now.name)
                    self.bursts.forget(now.name)
            changed = [now for _, now in pairs]
        for r in changed:
            self._reload_cost(r.name, r.engine)
        if pairs is None or any(before.engine.block_size != now.engine.block_size for before, now in pairs):
            self._block_sizes = tuple(sorted({r.engine.block_size for r in new.replicas if r.engine.block_size}))
        return changed

    def _reload_cost(self, name: str, engine: EngineView) -> None:
        self._load[name] = load_cost(engine, self.seqs.get(name, 0), self.tokens.get(name, 0), self.weights,
                                     self.cfg.replica_capacity)

    def _newest_adapters(self, view: PoolView) -> PoolView:
        """`view` with the newer of its declared adapters and those routed by now: two readers of the
        pool (discovery's watch and the routing Lease's renewals) can deliver them out of order, and
        what a gateway routes `<run>` to must never move back (a run's steps only grow). A pool whose
        `spec.adapters` was cleared by hand starts its serials over: restart its gateways then."""
        if _serial(view.adapters) < _serial(self.view.adapters):
            return dataclasses.replace(view, adapters=self.view.adapters)
        return view

    def declared_serial(self) -> int | None:
        """The `spec.adapters.serial` of the declared adapters routed by now; None: no pool declares any."""
        return None if self.view.adapters is None else self.view.adapters.serial

    def learn_declared(self, pool: dict[str, Any]) -> bool:
        """A SamplerPool object read by the routing Lease's renewal (or its watch): its declared
        adapters are routed by at once when newer than those routed by now. So a gateway that renews
        its Lease routes by adapters at least as new as its last renewal's read, whatever its
        discovery's watch delivered: the acknowledgement it writes next is true (adapter_acks.py).
        True when they moved on."""
        try:
            state = adapter_state(pool)
        except Conflict:  # a hand edit broke it: discovery logs it and keeps the last good state
            return False
        if state.serial <= _serial(self.view.adapters):
            return False
        self.view = dataclasses.replace(self.view, adapters=state)
        trace(self.who, "adapters.seen", serial=state.serial)
        if self.on_adapters is not None:
            self.on_adapters()
        self._notify()
        return True

    def _usable(self, r: ReplicaView) -> bool:
        return r.ready and not r.draining and r.name not in self._lost

    def usable(self) -> list[ReplicaView]:
        """Ready, not draining, not seen failing, whatever weights they serve and the switch permits:
        the members of a push over the network, which brings each of them to the pushed weights (a
        replica left behind by a push it missed is exactly one the next push must reach)."""
        return [r for r in self.view.replicas if self._usable(r)]

    def candidates(self) -> list[ReplicaView]:
        """Ready, not draining, not seen failing, at a label the pool's switch permits: before the
        version policy. Kept until one of those changes (a new view, a replica lost or back, the switch):
        asked per request, it would otherwise be a Python loop over the pool each time. Not to mutate."""
        permitted = self.switch.permitted() if self.switch is not None else None
        if self.view is not self._cands_view or (self._lost_changes, permitted) != self._cands_key:
            lost = self._lost
            self._cands = [r for r in self.view.replicas if r.ready and not r.draining and r.name not in lost
                           and (permitted is None or r.weights_label in permitted)]
            self._cands_view, self._cands_key = self.view, (self._lost_changes, permitted)
        return self._cands

    async def held(self, label: str) -> None:
        """Before an answer on `label` is offered to `returned`: while the pool's switch forbids it
        only because it is moving TO it (a fence for it, a newer label than the one open, or this
        gateway's Lease about to be renewed), wait for the switch to permit it, up to
        `--no-replica-wait-s`. An answer on the new weights that came back a moment early (a Keep
        load moved its last tokens on) is returned whole instead of run again."""
        start = self.clock()
        deadline = start + self.cfg.no_replica_wait_s
        if not self._moving_to(label):
            return
        trace(self.who, "answer.held", label=label)
        while self._moving_to(label) and (left := deadline - self.clock()) > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)
        trace(self.who, "answer.released", label=label, waited_s=f"{self.clock() - start:.3f}")

    def _moving_to(self, label: str) -> bool:
        if self.switch is None:
            return False
        permitted = self.switch.permitted()
        if permitted is None or label in permitted:
            return False
        routing = self.switch.routing
        return routing is None or label == routing.label or (
            rank(self.order.ranks, label, self.target) > rank(self.order.ranks, routing.label, self.target))

    def switched(self) -> None:
        """The pool's routing switch moved (routing/switch.py): requests waiting for a replica look again."""
        self._notify()

    def eligible(self) -> list[ReplicaView]:
        """The replicas a new request may go to now, no exclusion (as `allowed()`, uncounted). Not to mutate."""
        return self._filter()[0]

    def _filter(self) -> tuple[list[ReplicaView], list[ReplicaView]]:
        """The version policy over `candidates()`, kept until they or the label order change."""
        cands = self.candidates()
        key = (self.order.ranks, self.order.newest_returned, self.target, self.min_label)
        if cands is not self._filtered_from or key != self._filtered_key:
            self._filtered = version_filter(cands, self.cfg.version_policy, self.order, self.target, self.min_label)
            self._filtered_from, self._filtered_key = cands, key
        return self._filtered

    # ---------------------------------------------------------------- decisions

    def choose(self, affinity: str | None = None, exclude: frozenset[str] = frozenset(),
               label: str | None = None, prefer: str | None = None, prompt: Prompt | None = None) -> ReplicaView:
        """The replica for a new request; `label` restricts to one weights label (a retry stays on
        the version it started on); `prefer` names the replica of the client's session, `affinity` its
        affinity key; `prompt`: what the scorer reads of the request (its decision is set on it).
        Raises NoReplica (503) when none may take it."""
        chosen = self._pick(affinity, exclude, label, prefer, prompt)
        if chosen is None:
            self.metrics.no_replica.inc()
            raise NoReplica(self.why_none(exclude, self._returnable(label)), self.cfg.retry_after_s)
        return chosen

    async def choose_within(self, wait_s: float, affinity: str | None = None, exclude: frozenset[str] = frozenset(),
                            label: str | None = None, prefer: str | None = None,
                            prompt: Prompt | None = None) -> ReplicaView:
        """`choose`, but when no replica may take the request now, wait up to `wait_s` for one that
        may, re-trying at each change of the pool: during a rollout step under Latest the first
        answer on the new weights can come back before its replica is in routing again, and the
        old ones may no longer answer; a trainer is better served by a short wait than by a 503."""
        deadline = self.clock() + wait_s
        chosen = self._pick(affinity, exclude, label, prefer, prompt)
        if chosen is not None:
            return chosen
        self.metrics.waiting.inc()
        try:
            while (chosen := self._pick(affinity, exclude, label, prefer, prompt)) is None:
                left = deadline - self.clock()
                if left <= 0:
                    return self.choose(affinity, exclude, label, prefer, prompt)  # the 503, counted, with the reason
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), left)
            return chosen
        finally:
            self.metrics.waiting.dec()

    def _returnable(self, label: str | None) -> str | None:
        """A retry's label restriction, while an answer on that label could still go back to a client.
        Once Latest has returned a newer label, none could (`returned` would drop it and forward.py run
        it again on the newest): the restriction is dropped and the policy picks, as it does for a stale
        answer. Without it, a sample re-run after its replica was lost, having waited on that replica
        while a rollout moved on (a stall until the kubelet's restart), found no replica it could
        run on and was a 502 (the Faults soak, bench/faults.py)."""
        if label is not None and is_stale(label, self.cfg.version_policy, self.order, self.target):
            return None
        return label

    def allowed(self, exclude: frozenset[str] = frozenset(), label: str | None = None) -> list[ReplicaView]:
        """The replicas a new request may go to now (`_pick`'s choice is among them; adapter
        placement chooses among them too, lora/router.py). Not to mutate: a first try's list is
        kept until the candidates or the label order change (`candidates`)."""
        label = self._returnable(label)
        if exclude or label is not None:
            cands = [r for r in self.candidates()
                     if r.name not in exclude and (label is None or r.weights_label == label)]
            allowed, rejected = version_filter(cands, self.cfg.version_policy, self.order, self.target, self.min_label)
        else:
            allowed, rejected = self._filter()
        for r in rejected:
            self.metrics.rejected_by_version.labels(replica=r.name).inc()
        return allowed

    async def changed(self, timeout_s: float) -> None:
        """Return at the next change that decides routing (`_notify`), or after `timeout_s`."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), max(0.0, timeout_s))

    def set_lora(self, name: str, lora: ReplicaLora) -> None:
        """The gateway loaded or unloaded an adapter on replica `name`: fresher news than its last
        /health (a later read says the same, or the replica's own answers correct it)."""
        current = self.view.by_name.get(name)
        if current is None:
            return
        self.view = self.view.replaced({name: dataclasses.replace(current, lora=lora)})
        self._notify()

    def _pick(self, affinity: str | None, exclude: frozenset[str], label: str | None,
              prefer: str | None, prompt: Prompt | None) -> ReplicaView | None:
        allowed = self.allowed(exclude, label)
        if self.cfg.picker == "least-loaded":
            owner = next((r for r in allowed if r.name == prefer), None)
            return owner or pick(allowed, self.in_flight, affinity=affinity, capacity=self.cfg.replica_capacity,
                                 turn=next(self._turn))
        return self.score(allowed, affinity, prefer, prompt)

    def score(self, allowed: list[ReplicaView], affinity: str | None = None, prefer: str | None = None,
              prompt: Prompt | None = None) -> ReplicaView | None:
        """The scorer's choice among `allowed` (score.decide): the prompt's overlap with what each replica
        was sent, and where its burst went, read here; its blocks are recorded under the replica chosen
        (and the burst's place), so the next sibling finds them before this request is answered."""
        if not allowed:
            return None
        overlap, burst = self.prefix_of(prompt)
        rule = "session"
        if prefer is None and affinity:
            prefer, rule = preferred(affinity, allowed).name, "affinity"
        explain = log.isEnabledFor(logging.DEBUG) or (prompt is not None and prompt.explain)
        if allowed is not self._scored and allowed != self._scored:  # the same objects: compared by identity
            self._scored, self._names = allowed, [r.name for r in allowed]
            self._positions = {n: i for i, n in enumerate(self._names)}
        decision = decide(allowed, load=self._load, seqs=self.seqs, tokens=self.tokens, overlap=overlap,
                          w=self.weights, capacity=self.cfg.replica_capacity, turn=next(self._turn), prefer=prefer,
                          prefer_rule=rule, burst=burst, explain=explain, names=self._names,
                          positions=self._positions)
        assert decision is not None
        self._routed(decision, prompt, overlap)
        return decision.replica

    def prefix_of(self, prompt: Prompt | None) -> tuple[dict[str, float], str | None]:
        """What the index says of `prompt`: the fraction of its blocks each replica holds (those holding
        some), and the replica its burst went to within the window (None: none)."""
        overlap: dict[str, float] = {}
        burst = None
        if prompt is None:
            return overlap, burst
        for size in self._block_sizes:
            blocks = prompt.chain(size)
            if blocks:
                for name, held in self.index.match(blocks).items():
                    overlap[name] = held / len(blocks)
                whole = prompt.whole(size)
                if burst is None and whole is not None and self.cfg.burst_window_s > 0:
                    burst = self.bursts.get(whole, self.clock())
        return overlap, burst

    def placed(self, replica: ReplicaView, prompt: Prompt | None, rule: str, overlap: dict[str, float]) -> None:
        """An adapter request was placed on `replica` (lora/router.py, by `rule`): what `score` does once
        it has chosen, so its siblings find its blocks and its burst."""
        share = overlap.get(replica.name, 0.0)
        explain = log.isEnabledFor(logging.DEBUG) or (prompt is not None and prompt.explain)
        self._routed(Decision(replica, rule, self.weights.prefix * share - self._load.get(replica.name, 0.0),
                              terms_of(replica, self.weights.prefix * share - self._load.get(replica.name, 0.0),
                                       overlap, self.seqs, self.tokens, self.weights, self.cfg.replica_capacity)
                              if explain else None), prompt, overlap)

    def _routed(self, decision: Decision, prompt: Prompt | None, overlap: dict[str, float]) -> None:
        chosen = decision.replica
        if prompt is not None:
            prompt.decision = decision
            own = chosen.engine.block_size
            blocks = prompt.chain(own) if own else ()
            if own and blocks:
                self.metrics.prompt_blocks.inc(len(blocks))
                self.metrics.prompt_blocks_held.inc(round(overlap.get(chosen.name, 0.0) * len(blocks)))
                self.index.record(chosen.name, blocks)
                whole = prompt.whole(own)
                if whole is not None and self.cfg.burst_window_s > 0:
                    self.bursts.put(whole, chosen.name, self.clock())
        self.metrics.rule(decision.rule).inc()
        if log.isEnabledFor(logging.DEBUG):
            log.debug("routed to %s: %s", chosen.name, decision.as_dict())

    def notify(self) -> None:
        """Something placement reads changed (an adapter request ended: a victim may be free now)."""
        self._notify()

    def _notify(self) -> None:
        """Wake the requests waiting for a replica (choose_within): something that decides routing changed."""
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
        if self.on_room is not None:
            self.on_room()

    def owner(self, name: str) -> ReplicaView | None:
        """The replica named by a routed id, whatever its state (a draining or unready replica still
        holds its futures); None when it is no longer part of the pool."""
        return self.view.by_name.get(name)

    def mark_lost(self, replica: ReplicaView, why: str) -> None:
        self._lost[replica.name] = (self.clock(), why)
        self._lost_changes += 1

    def returned(self, replica: ReplicaView, label: str, version: int | None = None, step: int | None = None) -> bool:
        """A response on `label` (at training `step`, when the answer says) is about to go back to a
        client: False if the version policy forbids it (stale), else record it (it may be the first
        of a newer label)."""
        self._answered_at[replica.name] = self.clock()
        view, newest, known = self.view, self.order.newest_returned, len(self.order.ranks)
        self.order.see([(label, version)], {label: step} if step is not None else None)
        self._observe(replica, label, version)
        permitted = self.switch.permitted() if self.switch is not None else None
        if permitted is not None and label not in permitted:
            # The pool's switch forbids it now (a fence, or another label open): not returned; the
            # caller runs it again on a permitted label, or answers "resubmit" (forward.py).
            self.metrics.stale.labels(replica=replica.name).inc()
            trace(self.who, "answer.withheld", label=label, replica=replica.name)
            return False
        if is_stale(label, self.cfg.version_policy, self.order, self.target):
            self.metrics.stale.labels(replica=replica.name).inc()
            return False
        self.order.note_returned(label, self.target)
        if self.order.newest_returned != newest:
            trace(self.who, "answer.first", label=label, replica=replica.name)
        if self.view is not view or self.order.newest_returned != newest or len(self.order.ranks) != known:
            self._notify()  # a new label, a newer one returned, a replica's new one: routing may change
        return True

    def answered_since(self, name: str, since: float) -> bool:
        """Did replica `name` answer a request at or after `since` (monotonic)?"""
        return self._answered_at.get(name, float("-inf")) >= since

    def _observe(self, replica: ReplicaView, label: str, version: int | None) -> None:
        """A response is fresher news than the last /health: the replica serves `label` now (so a
        newer label routes at once, not one refresh later)."""
        current = self.view.by_name.get(replica.name)
        if current is None or current.weights_label == label:
            return
        if rank(self.order.ranks, label, self.target) < rank(self.order.ranks, current.weights_label, self.target):
            return  # an answer computed before the replica's last load: it says nothing about now
        updated = dataclasses.replace(current, weights_label=label,
                                      weights_version=version if version is not None else current.weights_version)
        # New weights: the replica reset its prefix cache with the write.
        self.index.forget(replica.name)
        self.bursts.forget(replica.name)
        self.view = self.view.replaced({replica.name: updated})

    @contextlib.contextmanager
    def lease(self, replica: ReplicaView, kind: str, prompt: Prompt | None = None) -> Iterator[None]:
        """Count a request as open to `replica` for as long as the block runs; new work counts its
        sequences and tokens too (the scorer's load)."""
        name = replica.name
        routed, gauge = self.metrics.of(name, kind)
        routed.inc()
        self.in_flight[name] = self.in_flight.get(name, 0) + 1
        gauge.set(self.in_flight[name])
        seqs, tokens = (prompt.sequences, prompt.load_tokens) if prompt is not None else (1, 0)
        if kind == "new":
            self._count(name, seqs, tokens)
        try:
            yield
        finally:
            self.in_flight[name] -= 1
            gauge.set(self.in_flight[name])
            if kind == "new":
                self._count(name, -seqs, -tokens)

    def _count(self, name: str, seqs: int, tokens: int) -> None:
        self.seqs[name] = self.seqs.get(name, 0) + seqs
        self.tokens[name] = self.tokens.get(name, 0) + tokens
        r = self.view.by_name.get(name)
        if r is not None:
            self._reload_cost(name, r.engine)

    def why_none(self, exclude: frozenset[str] = frozenset(), label: str | None = None) -> str:
        if not self.view.replicas:
            return f"pool {self.cfg.pool!r} has no replicas (yet)"
        if self.switch is not None and self.switch.permitted() == frozenset():
            routing = self.switch.routing
            return (f"pool {self.cfg.pool!r} is switching its routing (generation {routing.generation}: fence "
                    f"before {routing.label!r})" if routing is not None and routing.phase == "Fence" and
                    self.switch.clock() <= self.switch.valid_until else
                    "this gateway has not renewed its routing Lease within its duration: it returns no answer")
        parts = []
        for r in self.view.replicas:
            if r.name in exclude:
                parts.append(f"{r.name}: already tried")
            elif r.name in self._lost:
                parts.append(f"{r.name}: lost ({self._lost[r.name][1]})")
            elif r.draining:
                parts.append(f"{r.name}: draining")
            elif not r.ready:
                parts.append(f"{r.name}: not ready ({r.reason})")
            elif label is not None and r.weights_label != label:
                parts.append(f"{r.name}: serves {r.weights_label!r}, not {label!r}")
            else:
                parts.append(f"{r.name}: serves {r.weights_label!r}, left out by version policy "
                             f"{self.cfg.version_policy} (newest returned {self.order.newest_returned!r}, "
                             f"target {self.target!r})")
        return "no replica may take this request now: " + "; ".join(parts)


def cache_reset(old: ReplicaView, new: ReplicaView) -> bool:
    """Pure: did the replica's prefix cache go between two views of it? A new address (another pod), a
    new process (`started_at`), or other weights (vLLM resets its prefix cache at every weights write)."""
    def changed(a: object, b: object) -> bool:
        return a is not None and b is not None and a != b
    return (old.url != new.url or changed(old.engine.started_at, new.engine.started_at)
            or changed(old.weights_version, new.weights_version) or changed(old.weights_label, new.weights_label))


def moves(old: PoolView, new: PoolView) -> list[tuple[ReplicaView, ReplicaView]] | None:
    """Pure: each replica whose view is another object in `new` than in `old`, as (old, new) views;
    None when `new` does not hold the same replicas in the same order (members came or went). A
    view that did not move is the same object (merge.py keeps it), so an identity test per replica
    finds what moved: a C-speed pass, not a Python one that compares fields."""
    if old.replicas is new.replicas:
        return []
    if len(old.replicas) != len(new.replicas):
        return None
    pairs = [(a, b) for a, b in zip(old.replicas, new.replicas, strict=True) if a is not b]
    if any(a.name != b.name for a, b in pairs):
        return None
    return pairs


def _serial(state: AdapterState | None) -> int:
    return -1 if state is None else state.serial
