"""The gateway's Prometheus metrics: what it decided, per replica. A registry per app (tests run
several gateways in one process)."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .added_latency import BUCKETS


@dataclass
class GatewayMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.in_flight = Gauge("sampler_gateway_replica_in_flight", "Requests the gateway has open to the replica",
                               ["replica"], registry=r)
        self.routed = Counter("sampler_gateway_routed", "Requests sent to the replica, by kind "
                              "(new: picked; owner: a future or session it owns)", ["replica", "kind"], registry=r)
        self.retried = Counter("sampler_gateway_retried", "Requests retried elsewhere after the replica was lost "
                               "before starting them", ["replica"], registry=r)
        self.rerun = Counter("sampler_gateway_rerun", "Sync samples re-run on another replica at the same weights "
                             "label after the replica was lost while running them", ["replica"], registry=r)
        self.lost = Counter("sampler_gateway_lost", "Requests that failed because the replica was lost while "
                            "running them", ["replica"], registry=r)
        self.rejected_by_version = Counter(
            "sampler_gateway_rejected_by_version", "Times a ready replica was left out of a pick by the version "
                                               "policy", ["replica"], registry=r)
        self.stale = Counter("sampler_gateway_stale_responses", "Responses on older weights than one already "
                             "returned (Latest), not returned", ["replica"], registry=r)
        self.no_replica = Counter("sampler_gateway_no_replica", "Requests answered 503: no eligible replica",
                                  registry=r)
        self.fair_waiting = Gauge("sampler_gateway_fair_waiting", "New requests waiting for a turn while the pool is "
                                  "full, by flow (a run, base, or id: every client fairness id), admission/gate.py",
                                  ["flow"], registry=r)
        self.fair_refused = Counter("sampler_gateway_fair_refused", "New requests refused 429 while the pool was full, "
                                    "by flow and why (queue_full: --fair-queue-max; waited_too_long: "
                                    "--fair-wait-s)", ["flow", "why"], registry=r)
        self.future_places = Gauge("sampler_gateway_future_places", "Submitted futures (native submit, Tinker "
                                   "asample) holding a place in the fair admission until their replica says they "
                                   "ended, future_places.py", registry=r)
        self.future_places_released = Counter(
            "sampler_gateway_future_places_released", "Places of submitted futures given back, by why (done: the "
            "future ended; gone: its replica no longer holds it or left the pool; unreachable: its replica did not "
            "answer; bound: past the sample's own timeout; no_route: a replica without /v1/sample/wait, at once; "
            "error: any other answer; shutdown)", ["why"], registry=r)
        self.waiting = Gauge("sampler_gateway_waiting_for_replica", "New requests waiting for a replica that may "
                             "take them (--no-replica-wait-s)", registry=r)
        self.gone = Counter("sampler_gateway_owner_gone", "Future/session requests whose owner is gone "
                            "(answered with the protocol's expired form)", registry=r)
        self.sessions = Gauge("sampler_gateway_sessions", "Sessions (X-Session-ID) the gateway remembers the replica "
                              "of (--session-table-size)", registry=r)
        self.session_moves = Counter("sampler_gateway_session_moves", "Session turns answered by another replica "
                                     "than the session's last one (it was lost, draining or left out by the "
                                     "version policy); the session stays on the new one", registry=r)
        self.streams_cut = Counter("sampler_gateway_streams_cut", "OpenAI streams the replica stopped sending "
                                   "before their end (lost, or past the request's timeout): ended with an error "
                                   "event", ["replica"], registry=r)
        self.adapter_loads = Counter("sampler_gateway_adapter_loads", "Adapter versions loaded on a replica on demand, "
                                     "by outcome (ok; full: the replica's 409, placed again; unavailable: its 5xx, "
                                     "placed again; refused: its other 4xx; lost: no answer, the replica left "
                                     "placement and the request was placed again)",
                                     ["replica", "outcome"], registry=r)
        self.adapter_unloads = Counter("sampler_gateway_adapter_unloads", "Adapter versions unloaded on a replica to "
                                       "make room for a request's version or a push's, by outcome (ok; in_flight: its "
                                       "409, placed again; unavailable: its 5xx, placed again; refused: its other "
                                       "answers; lost: no answer, placed again)",
                                       ["replica", "outcome"], registry=r)
        self.adapter_slot_waiting = Gauge("sampler_gateway_adapter_slot_waiting", "Adapter requests waiting for a "
                                          "LoRA slot (every slot holds versions with requests in flight), in turn "
                                          "across flows, lora/router.py", registry=r)
        self.adapter_replaced = Counter("sampler_gateway_adapter_replaced", "Adapter requests placed again because "
                                        "their replica no longer held the version (its unknown-adapter answer), or "
                                        "failed or left while placing it (lora/router.py)",
                                        ["replica"], registry=r)
        self.replicas = Gauge("sampler_gateway_replicas", "Replicas by state", ["state"], registry=r)
        self.routed_by = Counter("sampler_gateway_routed_by_rule", "New requests by the endpoint scorer's rule that "
                                 "chose their replica (session, affinity, burst, prefix, least-loaded; "
                                 "routing/score.py)", ["rule"], registry=r)
        self.prompt_blocks = Counter("sampler_gateway_prompt_blocks", "Prompt blocks of the new requests the scorer "
                                     "routed (routing/prefix.py: the replica's KV block size, in tokens or "
                                     "characters)", registry=r)
        self.prompt_blocks_held = Counter("sampler_gateway_prompt_blocks_held", "Of them, the blocks the prefix "
                                          "index predicted cached on the replica chosen: over "
                                          "sampler_gateway_prompt_blocks, the predicted prefix-cache hit rate",
                                          registry=r)
        self.index_blocks = Gauge("sampler_gateway_prefix_index_blocks", "Prompt blocks the prefix index holds, all "
                                  "replicas (--prefix-index-blocks per replica at most)", registry=r)
        self.added_latency = Histogram(
            "sampler_gateway_added_latency_seconds", "Per forwarded request: its time in the gateway minus its "
            "exchanges with replicas (added_latency.py defines it exactly)", buckets=BUCKETS, registry=r)
        self._per_request: dict[tuple[str, str], tuple[Counter, Gauge]] = {}
        self._rules: dict[str, Counter] = {}

    def of(self, replica: str, kind: str) -> tuple[Counter, Gauge]:
        """The two series every request touches (routed, in flight), looked up once per replica and
        kind: `labels()` costs a lock and a tuple build, on the hot path twice a request."""
        key = (replica, kind)
        if (found := self._per_request.get(key)) is None:
            found = self._per_request[key] = (self.routed.labels(replica=replica, kind=kind),
                                              self.in_flight.labels(replica=replica))
        return found

    def rule(self, rule: str) -> Counter:
        """`routed_by` for one rule, looked up once (a handful of rules, each request touches one)."""
        if (found := self._rules.get(rule)) is None:
            found = self._rules[rule] = self.routed_by.labels(rule=rule)
        return found

    def render(self) -> bytes:
        return generate_latest(self.registry)
