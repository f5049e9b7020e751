"""Gateway configuration: every flag, its default and its help, written once in `GatewayConfig`.

The same scheme as the sampler's `sampler_pod/config.py`: field `refresh_interval_s` is the flag
`--refresh-interval-s` and the environment variable `SAMPLER_GATEWAY_REFRESH_INTERVAL_S`; a flag
wins over the environment, the environment over the default, and pydantic validates all three.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, model_validator

from sampler_common.flags import Flags

VersionPolicy = Literal["Latest", "MinVersion", "Any"]

ENV_PREFIX = "SAMPLER_GATEWAY_"


class GatewayConfig(BaseModel):
    pool: str = Field(..., min_length=1,
                      description="the pool's name (SamplerReplicas labelled sampler.rl.dev/pool=NAME)")
    namespace: str = Field("default", min_length=1, description="namespace of the pool's SamplerReplicas")
    host: str = Field("0.0.0.0", description="address to listen on")
    port: int = Field(8080, ge=1, le=65535, description="port to listen on")
    reuse_port: bool = Field(
        False, description="listen with SO_REUSEPORT: several gateways on one host network (hostNetwork pods of "
                           "one Deployment on one node) share the port, the kernel spreading connections among them")

    # Where the replica set comes from (discovery/).
    discovery: Literal["kube", "static"] = Field(
        "kube", description="`kube`: watch the pool's SamplerReplicas and pods on the API server; "
                            "`static`: the --replica flags or --replicas-file (tests, running outside Kubernetes)")
    replicas: list[str] = Field(
        default_factory=list, description="a replica as NAME=URL (flag --replica, repeatable; env: comma-separated)")
    replicas_file: Path | None = Field(
        None, description='JSON list of {"name", "url", "draining"?}, re-read when it changes (static discovery)')
    adapters_file: Path | None = Field(
        None, description="static discovery: JSON of the pool's declared adapters, as the SamplerPool's spec.adapters "
                          "(kube discovery reads them from the pool), re-read when it changes")
    refresh_interval_s: float = Field(
        0.5, gt=0, le=60.0, description="how often each replica's /health is read when nothing changes; a change of "
                                        "the replica set (a drain, a new replica) is acted on at once")
    health_timeout_s: float = Field(
        1.0, gt=0, description="a /health read taking longer is unanswered (bounded by --refresh-interval-s)")
    health_failure_threshold: int = Field(
        3, ge=1, description="consecutive unanswered /health reads before a ready replica leaves routing "
                             "(a busy replica answers late; an answer that is not ok counts at once)")
    share_health_reads: bool = Field(
        True, description="kube discovery: share the replicas' /health reads with the pool's other gateways, each "
                          "replica read by one of them every --refresh-interval-s (discovery/peers.py); needs an "
                          "address of its own for its peers (--pod-ip, or a --host that is not a wildcard), and is "
                          "off with --reuse-port")
    pod_ip: str | None = Field(
        None, min_length=1, description="this gateway pod's IP (the operator sets it from the pod's status.podIP): "
                                        "where the pool's other gateways reach it to share /health reads")

    # The pool's routing switch (kube discovery: routing/switch.py).
    pod_name: str | None = Field(
        None, min_length=1, description="this gateway's pod, the holder of its routing Lease (kube discovery; "
                                        "the operator sets it from the pod's name; default: HOSTNAME-PID)")
    routing_lease_s: int = Field(
        10, ge=2, le=300, description="the routing Lease's duration: a gateway that has not renewed it (and read "
                                      "the pool) for this long returns no answer, and the pool's switch stops "
                                      "waiting for it")
    routing_renew_s: float = Field(
        3.0, gt=0, description="how often the routing Lease is renewed and the pool's routing read when nothing "
                               "changes (a change is acknowledged at once, a failed renewal retried within 1 s): the "
                               "gateway's only writes at steady state, one per interval")

    # Routing.
    version_policy: VersionPolicy = Field(
        "Latest", description="Latest: only the newest weights label; MinVersion: labels at or after --min-label; "
                              "Any: every ready replica")
    target_label: str | None = Field(
        None, min_length=1, description="the pool's target weights label (Latest routes only to it once a replica "
                                        "serves it); unset: the newest label the gateway has seen")
    min_label: str | None = Field(None, min_length=1, description="MinVersion's floor: the oldest label still served")
    affinity_header: str = Field(
        "X-Sampler-Affinity", min_length=1,
        description="request header whose value (a GRPO group, a session id) prefers one replica")
    session_header: str = Field(
        "X-Session-ID", min_length=1,
        description="request header naming a client's session on the OpenAI routes: its turns stay on the replica "
                    "that answered the last one while it is eligible (sessions.py)")
    session_table_size: int = Field(
        100_000, ge=1, description="sessions remembered per gateway; past it the least recently used is forgotten "
                                   "(its next turn goes to the least-loaded replica, as a first turn)")
    session_expiry_s: float = Field(
        3600.0, gt=0, description="a session with no turn for this long is forgotten (as past --session-table-size)")
    lora_slots: int = Field(
        4, ge=0, description="adapters a replica may hold at once when its /health does not say (an older sampler "
                             "without lora_slots and max_loras): the sampler's default --max-loras")
    replica_capacity: int = Field(
        128, ge=1, description="in-flight requests per replica past which an affinity key, a session or a burst "
                               "spills over to another replica (the replicas' --concurrent-task-limit); past it "
                               "for every eligible replica, new requests wait their flow's turn "
                               "(admission/gate.py)")

    # The endpoint picker (routing/score.py, prefix.py; docs/design/prefix-routing.md).
    picker: Literal["score", "least-loaded"] = Field(
        "score", description="score: prefix-cache overlap against load, behind a load gate (routing/score.py); "
                             "least-loaded: the gateway's in-flight requests only, affinity keys spilling at "
                             "--replica-capacity, a session's replica whenever eligible (the picker before #52)")
    score_prefix_weight: float = Field(
        1.0, ge=0, description="weight of the prompt's prefix overlap with a replica's cached blocks (0..1): 0 "
                               "routes by load alone")
    score_load_weight: float = Field(
        1.0, ge=0, description="weight of the sequences this gateway has in flight on a replica, over "
                               "--replica-capacity")
    score_tokens_weight: float = Field(
        1.0, ge=0, description="weight of the tokens (prompts and max_tokens) this gateway has in flight on a "
                               "replica, over its KV cache's tokens (its /health kv_cache_blocks x kv_block_size)")
    score_queue_weight: float = Field(
        1.0, ge=0, description="weight of the requests waiting in a replica's engine (its /health queue_depth), "
                               "over --replica-capacity")
    score_kv_weight: float = Field(
        1.0, ge=0, description="weight of a replica's KV-cache usage (its /health kv_cache_usage, 0..1)")
    score_imbalance: int = Field(
        64, ge=0, description="a replica more than this many sequences above the least loaded one (and past "
                             "--score-imbalance-ratio) is hot: its cached prefix, a session or an affinity key "
                             "no longer keeps requests on it")
    score_imbalance_ratio: float = Field(
        1.5, ge=1.0, description="... and more than this many times the least loaded one's sequences (both "
                                 "thresholds must be passed, as in vllm-router's cache_aware)")
    burst_window_s: float = Field(
        2.0, ge=0, description="a request whose whole prompt went to a replica this recently joins it while it "
                               "has fewer than --replica-capacity sequences, hot or not: n samples of a prompt sent "
                               "as n requests land together; 0: off")
    prefix_index_blocks: int = Field(
        8192, ge=1, description="prompt blocks remembered per replica, least recently routed out first (at most "
                                "256 bytes each: 2 MiB per replica at the default); set it near a replica's KV "
                                "cache blocks (/health kv_cache_blocks), more for text prompts")

    # Fairness across flows once the pool is full (admission/gate.py, fair_queue.py).
    fair_shares: list[str] = Field(
        default_factory=list, description="a run's share of turns as RUN=WEIGHT (flag --fair-share, repeatable; "
                                          "env: comma-separated); every other flow has 1")
    fair_queue_max: int = Field(
        1024, ge=1, description="requests of one flow waiting for a turn past which that flow's next is a 429")
    fair_wait_s: float = Field(
        120.0, gt=0, description="a request waiting this long for a turn (the pool stayed full) is a 429")

    # Requests.
    api_key: str | None = Field(None, description="API key required on every route but the probes (forwarded as is)")
    admin_api_key: str | None = Field(
        None, description="the pool's admin key: required by /v1/pool/* (push weights, read the rollout); also "
                          "accepted wherever --api-key is (the replicas accept it too)")
    request_timeout_s: float = Field(
        300.0, gt=0, description="a request's timeout when it names none (the replicas' --request-timeout-s)")
    max_request_timeout_s: float = Field(3600.0, gt=0, description="largest timeout_s honoured")
    upstream_grace_s: float = Field(
        15.0, gt=0, description="added to a request's own timeout to bound the call to its replica (the replica "
                                "answers 504 itself first, after aborting)")
    control_timeout_s: float = Field(
        10.0, gt=0, description="bound of the short calls: submits, sessions, cancels, capabilities")
    transfer_timeout_s: float = Field(
        3600.0, gt=0, description="a push over the network (vLLM's weight-transfer routes): the bound of its "
                                  "update_weights on each replica (the whole transfer) and of its finish (each "
                                  "replica's write; with a SamplerPool, the rollout the push declares)")
    max_body_bytes: int = Field(8 << 20, ge=1024, description="largest request body; past it: 413")
    no_replica_wait_s: float = Field(
        10.0, ge=0, description="how long a new request waits for a replica that may take it (a rollout batch "
                                "coming back, a replica starting) before the 503 no_replica; 0: answer at once")
    retry_after_s: int = Field(1, ge=1, description="Retry-After of a 503 when no replica may take the request")
    log_level: str = Field("info", description="log level")

    @model_validator(mode="after")
    def _check(self) -> GatewayConfig:
        if self.discovery == "static" and not self.replicas and self.replicas_file is None:
            raise ValueError("--discovery static needs --replica NAME=URL or --replicas-file")
        if self.routing_renew_s * 2 > self.routing_lease_s:
            raise ValueError("--routing-renew-s must be at most half of --routing-lease-s (one failed renewal "
                             "must not fence the gateway)")
        self.fair_shares_by_run()
        for r in self.replicas:
            name, sep, url = r.partition("=")
            if not sep or not name or not url.startswith(("http://", "https://")):
                raise ValueError(f"--replica {r!r}: expected NAME=http://HOST:PORT")
        return self

    def fair_shares_by_run(self) -> dict[str, float]:
        """--fair-share RUN=WEIGHT, by run."""
        out = {}
        for entry in self.fair_shares:
            run, sep, weight = entry.partition("=")
            try:
                share = float(weight)
            except ValueError:
                share = 0.0
            if not sep or not run or not share > 0:
                raise ValueError(f"--fair-share {entry!r}: expected RUN=WEIGHT with a positive weight")
            out[run] = share
        return out

    def peer_url(self) -> str | None:
        """Where the pool's other gateways reach this one to share /health reads (discovery/peers.py);
        None: it shares none (static discovery, sharing off, a shared port, no address of its own)."""
        if self.discovery != "kube" or not self.share_health_reads or self.reuse_port:
            return None
        host = self.pod_ip or (None if self.host in ("0.0.0.0", "::", "") else self.host)
        if host is None:
            return None
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    def static_members(self) -> list[tuple[str, str]]:
        """(name, url) of every --replica flag."""
        return [(n, u.rstrip("/")) for n, _, u in (r.partition("=") for r in self.replicas)]


FLAGS = Flags(GatewayConfig, prog="python -m sampler_gateway", env_prefix=ENV_PREFIX,
              description="The pool's gateway: one address in front of its sampler replicas.",
              flag_names={"replicas": "--replica", "fair_shares": "--fair-share"},
              list_separator=",")  # URLs hold colons


def parse_config(argv: Sequence[str] | None = None, environ: dict[str, str] | None = None) -> GatewayConfig:
    return FLAGS.parse(argv, environ)
