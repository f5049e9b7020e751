"""Node tier, issue #51: weights over the network into a SamplerPool of 2 REAL vLLM replicas on the REAL
kubelet, whose pods mount no checkpoint volume at all (the pod spec is checked): no shared disk anywhere.

1. A trainer process (tests/support/trainer.py: a Hugging Face model, `Pool.push_weights`) pushes through
   the gateway pod. It runs beside pytest, inside the node tier's private network namespace, where the
   pods' hostNetwork is the node's: the replicas reach the trainer's gloo store and listener at
   127.0.0.1, the trainer reaches theirs there too, and nothing leaves `lo`. The push is declared as
   `spec.weights = {versionLabel, step, sha256}` and rolled out; each replica's greedy output then equals
   Hugging Face's, and the digest equals the one computed here from the checkpoint file.
2. One replica's pod is deleted: the operator's new pod starts with `--initial-sha256`, waits unready,
   catches up from its peer (`weights_source: peer <url>`) and only then is Ready; its greedy output
   equals the peer's and Hugging Face's. Meanwhile (a `ServingWatch`) no pod reports `ok` at another
   label, and neither a pod nor the gateway answers on other weights.
3. Every replica's pod is deleted: with no peer and no durable copy, the pool stays unready with the
   reason (each replica `WeightsSynced=False/WeightsUnavailable`, its pod's reason, an Event). Over the
   whole wait, from the deletion until both new pods have started their engines, reported their reason
   and the operator wrote the condition (the API server's state ends the window, not a timer), the test
   fails if anything serves: once the old pods' containers are gone (docker says so), a pod reporting
   `ok`, or any sample answered by a pod or the gateway.

Three vLLM starts in the first two steps and two in the third, on 2 cores. The cluster is the tier's
session cluster; the operator is this module's, as in every pool module.
"""
from __future__ import annotations

import contextlib
import json
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sampler_pod.testing import net
from tests.operator.node.test_node_tier import Api, _log, cpu_engine_args, replica, watched_namespace
from tests.operator.node.test_pool_node import (
    Gateway,
    apply_pool,
    eligible_at,
    pool_api,
    pool_body,
    pool_key,
    pool_operator,
    pool_status,
    wait_pool,
)
from tests.support import k8s as ks
from tests.support.checkpoints import hf_greedy, perturbed_checkpoint
from tests.support.network_push import checkpoint_sha256, trainer_process

pytestmark = [pytest.mark.node, pytest.mark.vllm]
k8s_node = ks.node_fixture()

G, V = "sampler.rl.dev", "v1alpha1"
POOL = "np"
PROMPT = [1, 17, 42, 99, 123, 7, 250, 31]
TOKENS = 16
SAMPLE = {"prompts": [PROMPT], "sampling_params": {"max_tokens": TOKENS, "temperature": 0.0}}


@pytest.fixture(scope="module")
def api(k8s_node) -> Api:
    return pool_api(k8s_node)


@pytest.fixture(scope="module")
def operator(k8s_node, api, tmp_path_factory):
    yield from pool_operator(k8s_node, tmp_path_factory)


@pytest.fixture
def ns(api, operator):
    yield from watched_namespace(api, operator)


def network_template(port: int, model: Path) -> dict[str, Any]:
    """A real vLLM replica that takes its weights over the network only: no `checkpoints` at all (no
    volume, no allowed root), the gloo backend on."""
    spec: dict[str, Any] = replica("t", port, model, engine="vllm",
                                   engineArgs={**cpu_engine_args(), "extraArgs": []},
                                   resources={"limits": {"memory": "4Gi"},
                                              "requests": {"cpu": "500m", "memory": "1Gi"}},
                                   health={"startupTimeoutSeconds": 600},
                                   weightTransfer={"backend": "gloo"})["spec"]
    del spec["checkpoints"]
    # Two CPU engines share the node's cores: vLLM's default binding would pin both to one.
    spec["pod"]["env"] = [{"name": "VLLM_CPU_OMP_THREADS_BIND", "value": "nobind"}]
    return spec


def assert_no_checkpoint_volume(pod: Any) -> None:
    """The pod's only data from outside is the model (the tiny-model cache, read-only); every other volume
    is the pod's own (emptyDirs: its lock, /tmp, /dev/shm) or a key; the sampler is given no checkpoint root."""
    model_vols = {v["name"] for v in ks.model_volumes()[0] if "hostPath" in v}
    for v in pod.spec.volumes or []:
        own = v.empty_dir is not None or v.secret is not None or v.projected is not None or v.config_map is not None
        assert own or v.name in model_vols, f"{pod.metadata.name} mounts volume {v.name}: {v}"
    [c] = [c for c in pod.spec.containers if c.name == "sampler"]
    for m in c.volume_mounts or []:
        assert m.name not in model_vols or m.read_only, (pod.metadata.name, m)
    argv = [*(c.command or []), *(c.args or [])]
    assert "--checkpoint-root" not in argv, argv
    assert argv[argv.index("--weight-transfer-backend") + 1] == "gloo", argv


class Replicas:
    """The pool's replicas as the test reaches them: replica i on port base + i (hostNetwork)."""

    def __init__(self, base: int, key: str) -> None:
        self.base, self.key = base, key

    def url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.base + i}"

    def health(self, i: int) -> dict[str, Any]:
        h: dict[str, Any] = httpx.get(self.url(i) + "/health", timeout=10).json()
        return h

    def greedy(self, i: int) -> list[int]:
        r = httpx.post(self.url(i) + "/v1/sample", headers={"X-API-Key": self.key}, timeout=60,
                       json={"prompts": [PROMPT], "sampling_params": {"max_tokens": TOKENS, "temperature": 0.0}})
        assert r.status_code == 200, r.text
        tokens: list[int] = r.json()["results"][0]["sequences"][0]["tokens"]
        return tokens


def old_containers(pods: list[str]) -> list[str]:
    """The ids of any container the kubelet still runs for these pods (dockershim's labels)."""
    out = []
    for pod in pods:
        out += subprocess.run(["docker", "ps", "-q", "--filter", f"label=io.kubernetes.pod.name={pod}"],
                              capture_output=True, text=True, check=True).stdout.split()
    return out


class ServingWatch:
    """Reads every replica port's /health and a greedy sample on each, and samples through the gateway (a
    thread of its own: with no replica to route to, the gateway holds a request a while), over and over,
    and records anything served on weights other than the push:

    * always: a pod `ok` at a label other than `label`; an answer (a pod's or the gateway's) on another
      label, or with tokens other than the pushed weights' greedy ones (`want`: the base model's differ);
    * `strict` (every replica's pod deleted, the old containers gone): a pod `ok` at all, any answer at all.
    The old pods may answer until they die; only `strict` makes that wrong. `strict_reads` counts the
    /health answers read under `strict` (the new pods' servers up, saying they wait)."""

    def __init__(self, replicas: Replicas, n: int, gateway: str, label: str, want: list[int]) -> None:
        self.replicas, self.n, self.gateway, self.label, self.want = replicas, n, gateway, label, want
        self.strict = False
        self.wrong: list[str] = []
        self.reads = self.strict_reads = self.gateway_tries = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._pods, daemon=True),
                         threading.Thread(target=self._gateway, daemon=True)]

    def __enter__(self) -> ServingWatch:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)

    def _answer(self, who: str, r: httpx.Response, strict: bool) -> None:
        if r.status_code != 200:
            return
        body = r.json()
        label, tokens = body.get("weights_label"), body["results"][0]["sequences"][0]["tokens"]
        if strict:
            self.wrong.append(f"{who} answered a sample at {label!r} with every pod deleted")
        elif label != self.label or tokens != self.want:
            self.wrong.append(f"{who} answered at {label!r}: {tokens}")

    def _pods(self) -> None:
        with httpx.Client(timeout=5, headers={"X-API-Key": self.replicas.key}) as c:
            while not self._stop.is_set():
                strict = self.strict  # read once per round: every read below came after it was set
                for i in range(self.n):
                    with contextlib.suppress(httpx.HTTPError, ValueError):
                        h = c.get(self.replicas.url(i) + "/health").json()
                        self.reads += 1
                        self.strict_reads += strict
                        if h.get("status") == "ok" and (strict or h.get("weights_label") != self.label):
                            self.wrong.append(f"replica {i} ok at {h.get('weights_label')!r} (started "
                                              f"{h.get('started_at')}, strict={strict})")
                    with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, IndexError):
                        self._answer(f"replica {i}", c.post(self.replicas.url(i) + "/v1/sample", json=SAMPLE),
                                     strict)
                self._stop.wait(0.2)

    def _gateway(self) -> None:
        with httpx.Client(timeout=30, headers={"X-API-Key": self.replicas.key}) as c:
            while not self._stop.is_set():
                strict = self.strict
                with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, IndexError):
                    self._answer("the gateway", c.post(self.gateway + "/v1/sample", json=SAMPLE), strict)
                    self.gateway_tries += 1
                self._stop.wait(0.2)


def condition(obj: dict[str, Any], kind: str) -> dict[str, Any] | None:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == kind), None)


def replica_crs(api: Api, ns: str) -> dict[str, dict[str, Any]]:
    items = api.custom.list_namespaced_custom_object(G, V, ns, "samplerreplicas")["items"]
    return {o["metadata"]["name"]: o for o in items}


@contextlib.contextmanager
def phase(what: str) -> Iterator[None]:
    t = time.monotonic()
    yield
    _log(f"{what}: {time.monotonic() - t:.0f}s")


@pytest.mark.timeout(1800)  # five vLLM starts (two at once twice), a trainer's start and a push, on 2 cores
def test_a_network_push_without_a_checkpoint_volume_a_replica_caught_up_from_its_peer_and_a_pool_left_waiting(
        api, ns, operator, tiny_model, tmp_path):
    model = Path(tiny_model)
    pushed = perturbed_checkpoint(model, tmp_path / "trainer" / "step-1", seed=51)  # the trainer's, local
    digest, want = checkpoint_sha256(pushed), hf_greedy(pushed, PROMPT, TOKENS)
    assert want != hf_greedy(model, PROMPT, TOKENS)  # the base model's output tells itself apart
    base, gw_port = net.free_ports(2), ks.free_port()
    names = [f"{POOL}-0", f"{POOL}-1"]

    with phase("pool up (2 vLLM replicas and the gateway)"):
        apply_pool(api, ns, pool_body(POOL, 2, network_template(base, model), gw_port))
        wait_pool(api, ns, POOL, 2, None, timeout=900)
        gw = Gateway(api, ns, POOL, gw_port)
        gw.wait(lambda h: eligible_at(h, set(names), None), "both replicas eligible", 300)
    key, admin = pool_key(api, ns, POOL), pool_key(api, ns, POOL, "admin-api-key")
    reps = Replicas(base, key)
    for name in names:
        assert_no_checkpoint_volume(api.core.read_namespaced_pod(api.status(ns, name)["podName"], ns))
    started = {i: reps.health(i)["started_at"] for i in range(2)}

    # ---------------------------------------------------------------- 1. the push, through the gateway
    with phase("trainer start and push"), trainer_process(gw.url, admin) as trainer:
        t = time.monotonic()
        out = trainer.push(pushed, label="net-1", step=1)
        push_s = time.monotonic() - t
    assert out["ok"], f"{out}\n{gw.diagnose()}"
    assert (out["result"]["sha256"], out["result"]["tensors"]) == (digest, 21), out
    _log(f"push of {out['result']['bytes']} bytes: {push_s:.1f}s from the call to the rollout's end")
    spec = api.custom.get_namespaced_custom_object(G, V, ns, "samplerpools", POOL)["spec"]
    assert spec["weights"] == {"versionLabel": "net-1", "step": 1, "sha256": digest}, spec["weights"]
    for i, name in enumerate(names):
        h = reps.health(i)
        assert (h["status"], h["weights_label"], h["weights_step"], h["weights_sha256"], h["weights_source"]) == \
            ("ok", "net-1", 1, digest, "push"), (name, h)
        assert h["started_at"] == started[i], (name, h)  # written into the running engine, no restart
        assert reps.greedy(i) == want, name
    wait_pool(api, ns, POOL, 2, "net-1", timeout=120)

    # ---------------------------------------------------------------- 2. one replica replaced: from its peer
    victim = names[1]
    old = api.status(ns, victim)["podName"]
    with phase(f"{victim} replaced and caught up"), \
            ServingWatch(reps, 2, gw.url, "net-1", want) as watched:
        api.cluster.kubectl("-n", ns, "delete", "pod", old, "--wait=false")

        st = api.wait_status(ns, victim, lambda s: s.get("podName") not in (None, old) and s.get("phase") == "Ready",
                             900, "Ready on a new pod")
    pod = api.core.read_namespaced_pod(st["podName"], ns)
    assert_no_checkpoint_volume(pod)
    env = {e.name: e.value for e in pod.spec.containers[0].env if e.value is not None}
    assert (env["SAMPLER_INITIAL_VERSION_LABEL"], env["SAMPLER_INITIAL_SHA256"]) == ("net-1", digest), env
    assert "SAMPLER_INITIAL_CHECKPOINT" not in env, env
    h = reps.health(1)
    assert h["started_at"] != started[1], h
    assert (h["status"], h["weights_label"], h["weights_step"], h["weights_sha256"], h["weights_source"]) == \
        ("ok", "net-1", 1, digest, f"peer {reps.url(0)}"), h
    assert reps.greedy(1) == reps.greedy(0) == want
    assert watched.reads > 20 and not watched.wrong, watched.wrong
    wait_pool(api, ns, POOL, 2, "net-1", timeout=300)
    gw.wait(lambda h: eligible_at(h, set(names), "net-1"), "both replicas eligible at net-1", 300)

    # ---------------------------------------------------------------- 3. every replica gone: unready, the reason
    pods = {n: api.status(ns, n)["podName"] for n in names}
    with phase("every pod deleted: the pool waiting, WeightsUnavailable"), \
            ServingWatch(reps, 2, gw.url, "net-1", want) as watched:
        for p in pods.values():
            api.cluster.kubectl("-n", ns, "delete", "pod", p, "--force", "--grace-period=0", "--wait=false")
        # From here no pod may answer: once the old containers are gone, nothing at all.
        ks.wait_for(lambda: not old_containers(list(pods.values())), 120, 0.2, "the old pods' containers gone")
        watched.strict = True
        strict_from = time.monotonic()

        def waiting() -> dict[str, dict[str, Any]] | None:
            objs = replica_crs(api, ns)
            for n, o in objs.items():
                c = condition(o, "WeightsSynced")
                if (o["status"].get("podName") in (None, pods[n]) or c is None
                        or (c["status"], c["reason"]) != ("False", "WeightsUnavailable")):
                    return None
            return objs

        objs = ks.wait_for(waiting, 900, 0.5, "both replicas' new pods waiting, WeightsUnavailable")
        # Each new pod reported its reason itself (its engine started: /startedz), with the push named.
        for i, n in enumerate(names):
            h = reps.health(i)
            assert h["status"] == "starting" and "network push net-1" in (h.get("reason") or ""), (n, h)
            assert httpx.get(reps.url(i) + "/startedz", timeout=10).status_code == 200, n
        r = httpx.post(gw.url + "/v1/sample", headers={"X-API-Key": key}, timeout=60,
                       json={"prompts": [PROMPT], "sampling_params": {"max_tokens": 4}})
        assert r.status_code == 503 and r.json()["error"]["category"] == "no_replica", r.text
    strict_s = time.monotonic() - strict_from
    for n, o in objs.items():
        c = condition(o, "WeightsSynced")
        assert c is not None and digest in c["message"] and "network push net-1" in c["message"], (n, c)
        assert o["status"].get("phase") != "Ready", (n, o["status"])
    assert pool_status(api, ns, POOL).get("readyReplicas", 0) == 0, pool_status(api, ns, POOL)
    events = {(e.involved_object.name, e.reason) for e in api.core.list_namespaced_event(ns).items
              if e.involved_object.kind == "SamplerReplica"}
    assert {(n, "WeightsUnavailable") for n in names} <= events, sorted(events)
    _log(f"nothing served for {strict_s:.0f}s with every pod deleted ({watched.strict_reads} reads of the new "
         f"pods' /health, {watched.gateway_tries} samples through the gateway)")
    assert watched.strict_reads > 20 and watched.gateway_tries > 5 and not watched.wrong, \
        json.dumps(watched.wrong[:10])
