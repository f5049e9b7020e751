"""Issue #24 acceptance 2 and 3 on the fast tier: one routing switch for all of a pool's gateways.

A REAL kube-apiserver, the operator as a subprocess, REAL sampler processes (fake engine) run by the
process kubelet, and gateway PROCESSES with kube discovery, each with its own routing Lease.

- 2 gateways; every client alternates its requests between them (and a third gateway started in the
  middle of the second rollout); 5 rollouts in each mode, Drain, Abort and Keep, under that load:
  no client ever receives an answer on older weights than one it already received (Keep: by the
  answer's label, its last token's), no answer sent after another was received is older than it, and
  no request fails. Under Abort a replica's load aborts its samples in flight, each answered
  "aborted, resubmit" (503) by design; the clients resubmit those, as a trainer does, and they are
  counted apart: any other non-200 is a failure.
- One gateway SIGKILLed while a switch is pending: the fence waits for its Lease no longer than the
  Lease's duration (+ the allowed clock skew + a controller step), the switch completes, and the
  surviving gateways keep the promise.
- Issue #32 acceptance 2: one gateway cut off from the API server mid-rollout (its only path to it,
  a TCP forwarder, cut), alive and serving: it fences itself within its Lease, the switch opens
  without it within the same bound, and once the path is back it enforces the open routing and
  serves the new label; cut off before a push, it serves the opened label within a renewal and a
  refresh of the path's return.
"""
from __future__ import annotations

import contextlib
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support import k8s as ks
from tests.support.closed_loop import older_after_newer
from tests.support.gateway import RunningGateway, run_gateway
from tests.support.operator_harness import ProcessKubelet
from tests.support.switch_clients import Clients, older_for_a_client
from tests.support.tcp_proxy import tcp_proxy

from .test_pool_controller import (
    G,
    V,
    base_copies,
    conditions,
    pool_body,
    pool_events,
    pool_key,
    pool_status,
    template,
)

pytestmark = pytest.mark.envtest
# The gateways' --routing-lease-s: the bound of a switch waiting for a dead gateway. Longer than the
# first batch of a Drain rollout takes here, so the fence surely starts before the dead one's Lease ends.
LEASE_S = 8
CLOCK_SKEW_S = 1.0   # sampler_operator.pool.routing.CLOCK_SKEW_S
RENEW_S = 0.5        # the gateways' --routing-renew-s
MAX_TOKENS = 40      # the fake engine's ~1 ms per token: a few hundredths of a second per sample
ROLLOUTS = 5
# A sample that takes at least LONG_S s on the fake engine (>= 1 ms a token, one sequence after another).
LONG_S = 15
LONG_BODY = {"prompts": [[1, 17, 42, 3]], "num_samples": LONG_S,
             "sampling_params": {"max_tokens": 1000, "temperature": 1.0, "seed": 7, "ignore_eos": True}}
HOLD_BODY = {**LONG_BODY, "num_samples": 2}   # at least 2 s


def body(n: int) -> dict[str, Any]:
    return {"prompts": [[1, 17, 42, 3 + n % 200]],
            "sampling_params": {"max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": n, "ignore_eos": True}}


def routing(api: Any, ns: str, pool: str) -> dict[str, Any]:
    return pool_status(api, ns, pool).get("routing") or {}


def open_at(api: Any, ns: str, pool: str, label: str) -> Any:
    """The pool rolled out to `label` and its routing switched to it."""
    s = pool_status(api, ns, pool)
    r = s.get("routing") or {}
    return (r.get("phase") == "Open" and r.get("label") == label and s.get("updatedReplicas") == 2
            and s.get("readyReplicas") == 2 and not r.get("waitingFor")
            and conditions(api, ns, pool).get("Progressing", ("",) * 3)[1] == "RolloutComplete" and s)


def roll(api: Any, ns: str, root: Path, label: str, mode: str) -> None:
    api.custom.patch_namespaced_custom_object(G, V, ns, "samplerpools", "s", {"spec": {
        "weights": {"checkpoint": str(root / label), "versionLabel": label}, "rollout": {"mode": mode}}})


def start_gateway(stack: contextlib.ExitStack, k8s: Any, ns: str, key: str, name: str, *flags: str,
                  kubeconfig: str | None = None) -> RunningGateway:
    """`kubeconfig`: the gateway reaches the API server through it (a forwarder the test cuts)."""
    env = {**k8s.subprocess_env(), "SAMPLER_GATEWAY_API_KEY": key}
    if kubeconfig is not None:
        env["KUBECONFIG"] = kubeconfig
    return stack.enter_context(run_gateway(
        None, "--pod-name", name, "--routing-lease-s", str(LEASE_S), "--routing-renew-s", str(RENEW_S), *flags,
        pool="s", namespace=ns, env=env))


def test_one_switch_for_all_gateways_over_drain_abort_and_keep_rollouts_and_a_gateway_killed(
        k8s: Any, api: Any, ns: str, operator: Any, tiny_model: Path, tmp_path: Path) -> None:
    labels = [f"step-{i}" for i in range(1, 3 * ROLLOUTS + 3)]
    root = base_copies(tiny_model, tmp_path / "ckpt", labels)
    kubelet = ProcessKubelet(api.core, ns, tmp_path / "pods")
    stack = contextlib.ExitStack()
    try:
        key = _create_pool(api, ns, tiny_model, root, labels[0], {"mode": "Drain", "maxUnavailable": 1})
        a = start_gateway(stack, k8s, ns, key, "gw-a")
        b = start_gateway(stack, k8s, ns, key, "gw-b")
        ks.wait_for(lambda: open_at(api, ns, "s", labels[0]), 120, 0.1, f"the pool open at {labels[0]}")
        clients = Clients([a.url, b.url], key, body).start()
        done: list[str] = [labels[0]]
        c: RunningGateway | None = None
        try:
            clients.wait_for(20, "load through both gateways")
            modes = ["Drain"] * ROLLOUTS + ["Abort"] * ROLLOUTS + ["Keep"] * ROLLOUTS
            for i, mode in enumerate(modes):
                label = labels[i + 1]
                roll(api, ns, root, label, mode)
                if i == 1:   # the third gateway starts in the middle of the second rollout
                    c = start_gateway(stack, k8s, ns, key, "gw-c")
                    clients.add(c.url)
                ks.wait_for(lambda label=label: open_at(api, ns, "s", label), 120, 0.05,
                            f"rollout {i + 1} ({mode}) open at {label}")
                done.append(label)
                clients.wait_for(8, f"answers at {label}")

            # --- one gateway SIGKILLed while a switch is pending: the fence cannot hear from it
            label = labels[-1]
            roll(api, ns, root, label, "Drain")
            assert c is not None
            # Its clients stop sending there first (as a Service's endpoints would): a request in flight
            # on a killed gateway dies with its connection, whatever the switch does.
            clients.remove(c.url)
            os.killpg(c.proc.pid, signal.SIGKILL)
            killed = time.monotonic()
            fence = ks.wait_for(lambda: (r := routing(api, ns, "s")).get("phase") == "Fence"
                                and r.get("label") == label and r, 60, 0.02, "the fence before the last label")
            ks.wait_for(lambda: open_at(api, ns, "s", label), 120, 0.05, f"open at {label} after the kill")
            opened = time.monotonic()
            done.append(label)
            clients.wait_for(8, f"answers at {label}")
        finally:
            per_client = clients.stop()
        # The fence waited for the dead gateway (it never acknowledged), and no longer than its Lease
        # allows: its last renewal was before the kill.
        assert "gw-c" in fence["waitingFor"], fence
        bound = LEASE_S + CLOCK_SKEW_S + 3.0   # + a controller step and the live gateways' round trip
        print(f"switch with a gateway killed: open {opened - killed:.1f} s after the kill (bound {bound} s)")
        assert opened - killed <= bound, (opened - killed, bound)
        events = pool_events(api, ns, "s")
        assert events.count("RoutingOpen") == len(done), events
        assert any("not waited for, Lease expired: gw-c" in m for m in _messages(api, ns, "RoutingOpen"))

        every = [x for xs in per_client.values() for x in xs]
        failed = [(x.status, x.error) for x in every if x.status != 200]
        print(f"{len(every)} answers, {clients.resubmitted} aborted and resubmitted, by label "
              f"{ {lbl: sum(x.label == lbl for x in every) for lbl in done} }")
        assert not failed, f"{len(failed)} of {len(every)} failed: {failed[:5]}"
        for i, xs in per_client.items():
            assert older_for_a_client(xs, done) == [], f"client {i} got older weights after newer"
        assert older_after_newer(every, done) == []
        assert {x.label for x in every} >= set(done[1:]), "a rollout's label never reached a client"
    finally:
        stack.close()
        kubelet.stop()


def test_a_gateway_cut_off_from_the_api_server_fences_itself_and_the_switch_opens_without_it(
        k8s: Any, api: Any, ns: str, operator: Any, tiny_model: Path, tmp_path: Path) -> None:
    """Issue #32 acceptance 2. Gateway b reaches the API server through a forwarder (tcp_proxy.py); a is
    direct. Mid-rollout (Drain; b has seen the first replica's drain mark, the fence is not written
    yet) the forwarder is cut: b lives on and keeps serving its clients, but can neither renew its
    Lease nor read the pool. So b never acknowledges the fence, and its discovery no longer sees the
    second replica's drain mark: b keeps sending work there. A long sample sent through b just before
    the cut runs there on the old label and ends well after the pool opened the new one (the
    replica's load waits for it). The switch allows b the old label only while its Lease holds; then
    b fences itself, and that sample must not be returned. A b whose self-fence failed returns it."""
    old, new = "step-1", "step-2"
    root = base_copies(tiny_model, tmp_path / "ckpt", [old, new])
    kubelet = ProcessKubelet(api.core, ns, tmp_path / "pods")
    stack = contextlib.ExitStack()
    try:
        key = _create_pool(api, ns, tiny_model, root, old, {"mode": "Drain", "maxUnavailable": 1,
                                                           "drainTimeoutSeconds": 120})
        proxy = stack.enter_context(tcp_proxy(*ks.apiserver_address(k8s.kubeconfig)))
        # a's clients wait through the fence, which waits for b's Lease (up to LEASE_S + CLOCK_SKEW_S + a
        # step): longer than the default --no-replica-wait-s would allow. b's 503s come after 2 s.
        a = start_gateway(stack, k8s, ns, key, "gw-a", "--no-replica-wait-s", "30")
        b = _gateway_via(proxy, stack, k8s, ns, key, tmp_path)
        ks.wait_for(lambda: open_at(api, ns, "s", old), 120, 0.1, f"the pool open at {old}")
        gen = routing(api, ns, "s")["generation"]
        b.wait(lambda h: h["routing"]["generation"] == gen and not h["routing"]["self_fenced"], f"Open({old}, {gen})")
        assert proxy.connections > 0, "gateway b did not reach the API server through the forwarder"
        clients_a = Clients([a.url], key, body, n=2).start()
        clients_b = Clients([b.url], key, body, n=2).start()
        executor = ThreadPoolExecutor(3)
        try:
            clients_a.wait_for(10, "load through gateway a")
            clients_b.wait_for(10, "load through gateway b")
            # Each replica busy for a few seconds as the rollout starts (a sample sent to it directly):
            # the first one's load waits for it, so the fence comes seconds after that replica's drain
            # mark, and the cut below, made once b has seen the mark, surely comes before the fence.
            urls = [r["url"] for r in b.health()["replicas"]]
            for url in urls:
                executor.submit(_post, url, key, HOLD_BODY)
            ks.wait_for(lambda: all(httpx.get(u + "/health", timeout=5).json()["in_flight"] >= 1 for u in urls),
                        30, 0.01, "a sample in flight on each replica")

            roll(api, ns, root, new, "Drain")
            b.wait(lambda h: any(r["draining"] for r in h["replicas"]), "the rollout's first drain mark")
            # A long sample through b, on the replica not draining (the only one b may route to): that
            # replica stays on the old label until it ends, well after the pool opens the new one.
            long = executor.submit(_post, b.url, key, LONG_BODY)
            proxy.cut()
            cut = time.monotonic()
            # b saw nothing past Open(old): the fence comes after the drained replica is back on `new`.
            at_cut = routing(api, ns, "s")
            assert (at_cut["generation"], at_cut["label"], at_cut["phase"]) == (gen, old, "Open"), at_cut

            fence = ks.wait_for(lambda: (r := routing(api, ns, "s")).get("phase") == "Fence"
                                and r.get("label") == new and r, 60, 0.02, f"the fence before {new}")
            # b self-fences within its Lease, enforcing what it last read (it never read the fence).
            fenced = b.wait(lambda h: h["routing"]["self_fenced"], "its self-fence", timeout=LEASE_S + 5)
            self_fenced = time.monotonic()
            ks.wait_for(lambda: (r := routing(api, ns, "s")).get("phase") == "Open" and r.get("label") == new,
                        60, 0.02, f"Open({new}) without gateway b")
            opened = time.monotonic()
            ks.wait_for(lambda: open_at(api, ns, "s", new), 120, 0.05, f"the rollout to {new} complete")
            clients_a.wait_for(8, f"answers at {new} through gateway a")
            # The long sample ended (the rollout could not complete before) while b is still cut off.
            long_answer = long.result(timeout=60)

            # While cut off, b answers 503 no_replica naming its Lease (not the pool's fence, which it never read).
            assert b.health()["routing"]["self_fenced"]
            r = httpx.post(b.url + "/v1/sample", json=body(0), headers={"X-API-Key": key}, timeout=30)
            probe = (r.status_code, r.headers.get("retry-after"), r.json()["error"])

            proxy.restore()
            restored = time.monotonic()
            final = routing(api, ns, "s")
            relearned_h = b.wait(lambda h: h["routing"]["generation"] == final["generation"]
                                 and not h["routing"]["self_fenced"], "the current routing after the restore")
            relearned = time.monotonic()
            ks.wait_for(lambda: any(x.status == 200 and x.label == new for x in clients_b.every()), 120, 0.05,
                        f"an answer at {new} through gateway b")
            serves_new = time.monotonic()
            lease = ks.wait_for(lambda: _lease_ack(api, ns, "gw-b") == final["generation"], 30, 0.1,
                                "gateway b's Lease acknowledging the open routing")
        finally:
            answers_a, answers_b = clients_a.stop(), clients_b.stop()
            executor.shutdown(wait=False, cancel_futures=True)

        every_a = [x for xs in answers_a.values() for x in xs]
        every_b = [x for xs in answers_b.values() for x in xs]
        print(f"gateway b cut off: self-fenced {self_fenced - cut:.2f} s after the cut (Lease {LEASE_S} s), "
              f"the pool open at {new} {opened - cut:.2f} s after it (bound {LEASE_S + CLOCK_SKEW_S + 3.0} s); "
              f"restored: b enforced the routing {relearned - restored:.2f} s later, answered {new} "
              f"{serves_new - restored:.2f} s later; gateway a: {len(every_a)} answers, gateway b: {len(every_b)}, "
              f"{sum(x.status == 503 for x in every_b)} of them 503")
        # The order: no client of either gateway got an older label after a newer one. b returned `old`
        # only while its Lease held (so before the pool opened `new`), and `new` only after it read the
        # pool again.
        for i, xs in [*answers_a.items(), *answers_b.items()]:
            assert older_for_a_client(xs, [old, new]) == [], f"a client got older weights after newer: {i}"
        assert older_after_newer(every_a + every_b, [old, new]) == []
        late_old = [x for x in every_b if x.status == 200 and x.label == old
                    and (x.received > opened or x.received > self_fenced + 1.0)]
        assert not late_old, f"gateway b returned {old} after its Lease ran out: {late_old[:3]}"
        sent, received, status, retry_after, doc = long_answer
        assert received - sent >= LONG_S and received > opened, (received - sent, received - opened)
        assert status != 200, f"gateway b returned {doc.get('weights_label')} after the pool opened {new} (long sample)"
        early_new = [x for x in every_b if x.status == 200 and x.label == new and x.received < restored]
        assert not early_new, f"gateway b returned {new} while cut off: {early_new[:3]}"

        # The switch: the fence waited for b, which never acknowledged it, and opened once b's Lease had
        # run out (its last renewal was before the cut), within the documented bound.
        assert "gw-b" in fence["waitingFor"], fence
        assert self_fenced - cut <= LEASE_S + 1.0, self_fenced - cut   # + /health's polling
        assert (fenced["routing"]["generation"], fenced["routing"]["label"], fenced["routing"]["phase"],
                fenced["routing"]["valid_for_s"]) == (gen, old, "Open", 0), fenced
        assert LEASE_S - RENEW_S <= opened - cut <= LEASE_S + CLOCK_SKEW_S + 3.0, opened - cut
        assert any("not waited for, Lease expired: gw-b" in m for m in _messages(api, ns, "RoutingOpen"))
        failed_a = [(x.status, x.error) for x in every_a if x.status != 200]
        assert not failed_a, f"{len(failed_a)} of {len(every_a)} through gateway a failed: {failed_a[:5]}"

        # What b answered while fenced: 503 no_replica, Retry-After, naming its Lease (not the pool's
        # fence, which it never read); the long sample too. Nothing but 200 and that 503 at any time.
        assert (status, retry_after, doc["error"]["category"]) == (503, "1", "no_replica"), long_answer
        assert "has not renewed its routing Lease" in doc["error"]["message"], long_answer
        assert probe[0] == 503 and probe[1] == "1" and probe[2]["category"] == "no_replica", probe
        assert "has not renewed its routing Lease" in probe[2]["message"], probe
        other = [(x.status, x.retry_after, x.body.get("error")) for x in every_b if x.status != 200
                 and not (x.status == 503 and x.retry_after == "1" and x.body["error"]["category"] == "no_replica")]
        assert not other, f"gateway b answered something other than 200 or 503 no_replica: {other[:5]}"
        fenced_503 = [x for x in every_b if x.status == 503 and self_fenced + 0.5 < x.received < restored]
        assert fenced_503, "no client of gateway b was answered while it was fenced"
        assert all("has not renewed its routing Lease" in x.body["error"]["message"] for x in fenced_503), \
            {x.body["error"]["message"] for x in fenced_503}

        # Restored: b enforces the open routing and acknowledges it in its Lease.
        assert (final["generation"], final["label"], final["phase"]) == (gen + 2, new, "Open"), final
        assert (relearned_h["routing"]["label"], relearned_h["routing"]["phase"]) == (new, "Open"), relearned_h
        assert lease
    finally:
        stack.close()
        kubelet.stop()


def test_a_gateway_cut_off_before_a_push_serves_the_opened_label_once_it_hears_from_the_api_server(
        k8s: Any, api: Any, ns: str, operator: Any, tiny_model: Path, tmp_path: Path) -> None:
    """Issue #32: gateway b is cut off before the trainer pushes, so its discovery keeps the old target
    label; the pool opens the new one without b. Once the forwarder is restored, b's Lease renews and
    its discovery lists again at once (KubeDiscovery.reconnect), so b answers the new label within a
    renewal and a refresh, not at the end of its watches' backoff (up to 30 s): until they list again,
    the old target ranks above the opened label and b, under Latest, answered 503."""
    old, new = "step-1", "step-2"
    root = base_copies(tiny_model, tmp_path / "ckpt", [old, new])
    kubelet = ProcessKubelet(api.core, ns, tmp_path / "pods")
    stack = contextlib.ExitStack()
    try:
        key = _create_pool(api, ns, tiny_model, root, old, {"mode": "Drain", "maxUnavailable": 1})
        proxy = stack.enter_context(tcp_proxy(*ks.apiserver_address(k8s.kubeconfig)))
        start_gateway(stack, k8s, ns, key, "gw-a")
        b = _gateway_via(proxy, stack, k8s, ns, key, tmp_path)
        ks.wait_for(lambda: open_at(api, ns, "s", old), 120, 0.1, f"the pool open at {old}")
        clients_b = Clients([b.url], key, body, n=2).start()
        try:
            clients_b.wait_for(10, "load through gateway b")
            proxy.cut()
            roll(api, ns, root, new, "Drain")
            ks.wait_for(lambda: open_at(api, ns, "s", new), 120, 0.05, f"the rollout to {new} complete")
            assert b.health()["target_label"] == old, "gateway b heard of the push while cut off"
            proxy.restore()
            restored = time.monotonic()
            ks.wait_for(lambda: any(x.status == 200 and x.label == new for x in clients_b.every()), 120, 0.02,
                        f"an answer at {new} through gateway b")
            serves_new = time.monotonic()
        finally:
            answers_b = clients_b.stop()
        print(f"gateway b cut off before the push: answered {new} {serves_new - restored:.2f} s after the restore")
        assert serves_new - restored <= RENEW_S + 2.0, serves_new - restored
        for i, xs in answers_b.items():
            assert older_for_a_client(xs, [old, new]) == [], f"a client got older weights after newer: {i}"
    finally:
        stack.close()
        kubelet.stop()

def _post(url: str, key: str, doc: dict[str, Any]) -> tuple[float, float, int, str | None, dict[str, Any]]:
    """(sent, received, status, Retry-After, body) of one POST /v1/sample."""
    sent = time.monotonic()
    r = httpx.post(url + "/v1/sample", json=doc, headers={"X-API-Key": key}, timeout=300)
    return sent, time.monotonic(), r.status_code, r.headers.get("retry-after"), r.json()


def _lease_ack(api: Any, ns: str, holder: str) -> int | None:
    from kubernetes import client

    lease = client.CoordinationV1Api(api.client).read_namespaced_lease(f"{holder}-routing", ns)
    raw = (lease.metadata.annotations or {}).get("sampler.rl.dev/routing-generation")
    return int(raw) if raw is not None else None


def _create_pool(api: Any, ns: str, tiny_model: Path, root: Path, label: str, rollout: dict[str, Any]) -> str:
    """The pool "s" of these tests: 2 replicas at `label` (a checkpoint under `root`), `rollout`; its key."""
    tpl = template(ks.free_port(), model=str(tiny_model), checkpoints={"allowedRoots": [str(root)]})
    api.custom.create_namespaced_custom_object(G, V, ns, "samplerpools", pool_body(
        "s", 2, tpl, weights={"checkpoint": str(root / label), "versionLabel": label}, rollout=rollout))
    return _wait_key(api, ns)


def _gateway_via(proxy: Any, stack: contextlib.ExitStack, k8s: Any, ns: str, key: str,
                 tmp_path: Path) -> RunningGateway:
    """Gateway b: it reaches the API server only through `proxy` (the test cuts it), and answers 503
    after 2 s without a replica it may use."""
    return start_gateway(stack, k8s, ns, key, "gw-b", "--no-replica-wait-s", "2",
                         kubeconfig=ks.kubeconfig_via(k8s.kubeconfig, proxy.port, tmp_path / "via-proxy.kubeconfig"))


def _wait_key(api: Any, ns: str) -> str:
    key = ks.wait_for(lambda: _key(api, ns), 60, 0.2, "the pool's key")
    assert key is not None
    return key


def _key(api: Any, ns: str) -> str | None:
    with contextlib.suppress(Exception):
        return pool_key(api, ns, "s")
    return None


def _messages(api: Any, ns: str, reason: str) -> list[str]:
    return [e.message for e in api.core.list_namespaced_event(ns).items
            if e.involved_object.kind == "SamplerPool" and e.reason == reason]
