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
"""
from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support import k8s as ks
from tests.support.closed_loop import older_after_newer
from tests.support.gateway import RunningGateway, run_gateway
from tests.support.operator_harness import ProcessKubelet
from tests.support.switch_clients import Clients, older_for_a_client

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
MAX_TOKENS = 40      # the fake engine's ~1 ms per token: a few hundredths of a second per sample
ROLLOUTS = 5


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


def start_gateway(stack: contextlib.ExitStack, k8s: Any, ns: str, key: str, name: str) -> RunningGateway:
    return stack.enter_context(run_gateway(
        None, "--pod-name", name, "--routing-lease-s", str(LEASE_S), "--routing-renew-s", "0.5",
        pool="s", namespace=ns, env={**k8s.subprocess_env(), "SAMPLER_GATEWAY_API_KEY": key}))


def test_one_switch_for_all_gateways_over_drain_abort_and_keep_rollouts_and_a_gateway_killed(
        k8s: Any, api: Any, ns: str, operator: Any, tiny_model: Path, tmp_path: Path) -> None:
    labels = [f"step-{i}" for i in range(1, 3 * ROLLOUTS + 3)]
    root = base_copies(tiny_model, tmp_path / "ckpt", labels)
    kubelet = ProcessKubelet(api.core, ns, tmp_path / "pods")
    stack = contextlib.ExitStack()
    try:
        tpl = template(ks.free_port(), model=str(tiny_model), checkpoints={"allowedRoots": [str(root)]})
        api.custom.create_namespaced_custom_object(G, V, ns, "samplerpools", pool_body(
            "s", 2, tpl, weights={"checkpoint": str(root / labels[0]), "versionLabel": labels[0]},
            rollout={"mode": "Drain", "maxUnavailable": 1}))
        key = ks.wait_for(lambda: _key(api, ns), 60, 0.2, "the pool's key")
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


def _key(api: Any, ns: str) -> str | None:
    with contextlib.suppress(Exception):
        return pool_key(api, ns, "s")
    return None


def _messages(api: Any, ns: str, reason: str) -> list[str]:
    return [e.message for e in api.core.list_namespaced_event(ns).items
            if e.involved_object.kind == "SamplerPool" and e.reason == reason]
