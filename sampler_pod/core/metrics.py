"""Prometheus metrics of one server. A registry per app, so tests can run several apps in one process."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


@dataclass
class Metrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.admitted = Counter("sampler_requests_admitted", "Sampling requests admitted", registry=r)
        self.rejected = Counter("sampler_requests_rejected", "Sampling requests rejected with 429", registry=r)
        self.finished = Counter("sampler_requests_finished", "Admitted requests by terminal state",
                                ["outcome"], registry=r)
        self.timed_out = Counter("sampler_requests_timed_out", "Requests that hit their timeout", registry=r)
        self.in_flight = Gauge("sampler_requests_in_flight", "Admitted, unfinished requests", registry=r)
        self.sequences_in_flight = Gauge("sampler_sequences_in_flight",
                                         "Sequences (prompts x num_samples) of admitted, unfinished requests",
                                         registry=r)
        self.futures_held = Gauge("sampler_futures_held", "Futures held: running or awaiting retrieval",
                                  registry=r)
        self.engine_running = Gauge("sampler_engine_requests_running", "Engine calls in progress", registry=r)
        self.engine_running_max = Gauge("sampler_engine_requests_running_max",
                                        "Most engine calls ever in progress at once", registry=r)
        self.tokens = Counter("sampler_generated_tokens", "Tokens generated", registry=r)
        self.latency = Histogram("sampler_request_latency_seconds", "Admission to terminal state",
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.weight_loads = Counter("sampler_weight_loads", "Checkpoint/adapter loads by outcome",
                                    ["outcome"], registry=r)
        # Pushes over the network (weights/transfer.py): received (then written, counted in weight_loads),
        # refused (a tensor that does not fit, a digest that differs) or torn (a peer died, a timeout).
        self.weight_transfers = Counter("sampler_weight_transfers", "Pushes over the network by outcome "
                                        "(received, refused, torn)", ["outcome"], registry=r)
        self.weight_transfer_bytes = Counter("sampler_weight_transfer_bytes", "Bytes of pushes received and "
                                             "verified over the network", registry=r)
        self.load_seconds = Histogram("sampler_weight_load_seconds", "Checkpoint load duration (validate + write)",
                                      buckets=_LATENCY_BUCKETS, registry=r)
        self.validation_seconds = Histogram("sampler_weight_validation_seconds", "Checkpoint validation duration",
                                            buckets=_LATENCY_BUCKETS, registry=r)
        self.write_lock_wait = Histogram("sampler_write_lock_wait_seconds",
                                         "Time sampling requests waited on a weight write",
                                         buckets=_LATENCY_BUCKETS, registry=r)
        self.write_lock_wait_max = Gauge("sampler_write_lock_wait_max_seconds",
                                         "Longest any sampling request waited on a weight write", registry=r)
        self.write_waiting = Gauge("sampler_weight_write_waiting",
                                   "Weight writes waiting for in-flight samples to drain", registry=r)
        self.weights_version = Gauge("sampler_weights_version", "Current weights version", ["label"], registry=r)
        self.weights_uncertain = Gauge("sampler_weights_uncertain", "1 if a weight write failed midway", registry=r)
        # The stall watch (core/stall.py): how often it tripped, the canaries' outcomes, and the longest
        # the engine went without a token while requests waited (the margin under --stall-timeout-s).
        self.engine_stalls = Counter("sampler_engine_stalls", "Times the engine was found stalled", registry=r)
        self.canaries = Counter("sampler_engine_canaries", "Canary generations by outcome (ok, failed)",
                                ["outcome"], registry=r)
        self.progress_gap_max = Gauge("sampler_engine_progress_gap_max_seconds",
                                      "Longest time requests waited in the engine with no token produced "
                                      "(outside the server's own pauses)", registry=r)

    def set_weights(self, version: int, label: str) -> None:
        self.weights_version.clear()
        self.weights_version.labels(label=label).set(version)

    def render(self) -> bytes:
        # vLLM registers its own engine metrics in the global registry; expose both.
        return generate_latest(self.registry) + generate_latest(REGISTRY)
