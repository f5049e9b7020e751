"""`sampler_client`, the trainer's side: importable with vLLM, kopf and the Kubernetes client blocked (a
subprocess), and its push/wait against a scripted gateway on 127.0.0.1 whose rollout moves one step per
read (so the client's waiting is driven by what it reads, never by time): progress lines per replica
change, complete, stopped (the replica and its reason in the exception), superseded, refused (4xx
naming the field). Against the real gateway, operator and API server: tests/operator/envtest/test_pool_push.py."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from sampler_client import (
    AdapterPushed,
    Pool,
    RequestRefused,
    Rollout,
    RolloutStopped,
    RolloutSuperseded,
    progress_lines,
)
from sampler_client.__main__ import main as cli
from tests.support import REPO_ROOT

ADMIN = "tml-admin"


def test_importable_without_vllm_kopf_or_the_kubernetes_client() -> None:
    blocked = ["vllm", "torch", "kopf", "kubernetes", "sampler_common", "sampler_pod", "sampler_gateway",
               "sampler_operator", "fastapi", "pydantic", "httpx", "aiohttp"]
    code = f"""
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {blocked!r}:
            raise ImportError('blocked: ' + name)
sys.meta_path.insert(0, Block())
import sampler_client, sampler_client.__main__
from sampler_client import Pool
assert not {{m.split('.')[0] for m in sys.modules}} & set({blocked!r})
print('ok')
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def replica(name: str, state: str, label: str, phase: str = "Ready") -> dict[str, Any]:
    return {"name": name, "phase": phase, "weights_label": label, "state": state, "draining": state == "Draining"}


def rollout(state: str, label: str, replicas: list[dict[str, Any]], *, observed: int = 5, updated: int = 0,
            message: str | None = None, stopped: str | None = None) -> dict[str, Any]:
    return {"pool": "w", "generation": 5, "observed_generation": observed, "target_label": label,
            "checkpoint": f"/ckpt/{label}", "step": None, "state": state, "reason": None, "message": message,
            "stopped_replica": stopped, "desired": 2, "updated": updated, "ready": 2, "replicas": replicas}


class Scripted:
    """A gateway's pool routes: the push answers `pushed` (or an error), each rollout read the next
    of `reads` (the last one repeats)."""

    def __init__(self, reads: list[dict[str, Any]], push_error: tuple[int, dict[str, Any]] | None = None,
                 adapter_reply: tuple[int, dict[str, Any]] = (404, {}),
                 adapter_first: list[tuple[int, dict[str, Any]]] | None = None) -> None:
        self.reads, self.push_error, self.adapter_reply = reads, push_error, adapter_reply
        self.adapter_first = list(adapter_first or [])  # answered (with Retry-After: 0) before adapter_reply
        self.pushes: list[tuple[str | None, dict[str, Any]]] = []
        self.gets = 0
        self.paths: list[str] = []   # each GET's path and query


@contextlib.contextmanager
def gateway(script: Scripted) -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def _answer(self, status: int, body: dict[str, Any], retry_after: str | None = None) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            if retry_after is not None:
                self.send_header("Retry-After", retry_after)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            script.pushes.append((self.headers.get("X-API-Key"), body))
            if self.path == "/v1/pool/adapters" and script.adapter_first:
                self._answer(*script.adapter_first.pop(0), retry_after="0")
            elif self.path == "/v1/pool/adapters":
                self._answer(*script.adapter_reply)
            elif script.push_error is not None:
                self._answer(*script.push_error)
            else:
                pushed = {**script.reads[0], "state": "Pending", "observed_generation": 4}
                if "resource_version" in pushed:   # a gateway with the long poll: the push's own write
                    pushed["resource_version"] = "pushed"
                self._answer(200, pushed)

        def do_GET(self) -> None:  # noqa: N802
            read = script.reads[min(script.gets, len(script.reads) - 1)]
            script.gets += 1
            script.paths.append(self.path)
            self._answer(200, read)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_push_waits_for_the_rollout_and_tells_each_replica_change() -> None:
    script = Scripted([
        rollout("Pending", "step-2", [replica("w-0", "Updated", "step-1"), replica("w-1", "Updated", "step-1")],
                observed=4),
        rollout("RollingOut", "step-2", [replica("w-0", "Updating", "step-1"), replica("w-1", "Outdated", "step-1")]),
        rollout("RollingOut", "step-2", [replica("w-0", "Updating", "step-1"), replica("w-1", "Outdated", "step-1")]),
        rollout("RollingOut", "step-2", [replica("w-0", "Updated", "step-2"), replica("w-1", "Updating", "step-1")],
                updated=1),
        rollout("Complete", "step-2", [replica("w-0", "Updated", "step-2"), replica("w-1", "Updated", "step-2")],
                updated=2),
    ])
    lines: list[str] = []
    with gateway(script) as url:
        done = Pool(url, ADMIN, poll_interval_s=0).push("/ckpt/step-2", "step-2", step=2, progress=lines.append)
    assert script.pushes == [(ADMIN, {"checkpoint": "/ckpt/step-2", "version_label": "step-2", "step": 2})]
    assert done.state == "Complete" and {r.weights_label for r in done.replicas} == {"step-2"}
    assert lines == [
        "w-0: Updated (phase Ready, serving step-1)", "w-1: Updated (phase Ready, serving step-1)",
        "rollout Pending: 0/2 updated to step-2",
        "w-0: Updating (phase Ready, serving step-1)", "w-1: Outdated (phase Ready, serving step-1)",
        "rollout RollingOut: 0/2 updated to step-2",
        # the repeated read told nothing new
        "w-0: Updated (phase Ready, serving step-2)", "w-1: Updating (phase Ready, serving step-1)",
        "w-1: Updated (phase Ready, serving step-2)", "rollout Complete: 2/2 updated to step-2",
    ]


@pytest.mark.timeout(60)
def test_waiting_long_polls_from_the_version_last_read_and_never_sleeps_while_the_pool_moves() -> None:
    def at(state: str, w0: tuple[str, str], w1: tuple[str, str], updated: int) -> dict[str, Any]:
        return rollout(state, "step-2", [replica("w-0", *w0), replica("w-1", *w1)], updated=updated)

    reads = [at("RollingOut", ("Updating", "step-1"), ("Updating", "step-1"), 0),
             at("RollingOut", ("Updated", "step-2"), ("Updating", "step-1"), 1),
             at("Complete", ("Updated", "step-2"), ("Updated", "step-2"), 2)]
    script = Scripted([{**r, "resource_version": str(7 + i)} for i, r in enumerate(reads)])
    with gateway(script) as url:
        # A poll interval far beyond the test's timeout: any sleep between reads would fail it.
        done = Pool(url, ADMIN, poll_interval_s=3600).push("/ckpt/step-2", "step-2", progress=False)
    assert done.state == "Complete" and done.resource_version == "9"
    assert script.paths == ["/v1/pool/rollout?after=pushed&wait_s=10.000", "/v1/pool/rollout?after=7&wait_s=10.000",
                            "/v1/pool/rollout?after=8&wait_s=10.000"]


def test_a_stopped_rollout_raises_naming_the_replica_and_its_reason() -> None:
    why = ("replica w-0 rejected step-bad: checkpoint: model.safetensors: tensor 'lm_head.weight' has shape "
           "[3, 4], expected [8, 4]; change spec.weights to go on")
    script = Scripted([rollout("Stopped", "step-bad", [replica("w-0", "Rejected", "step-1"),
                                                       replica("w-1", "Outdated", "step-1")],
                               message=why, stopped="w-0")])
    with gateway(script) as url, pytest.raises(RolloutStopped) as e:
        Pool(url, ADMIN, poll_interval_s=0).push("/ckpt/bad", "step-bad", progress=False)
    assert e.value.replica == "w-0" and e.value.reason == why
    assert "replica w-0" in str(e.value) and "model.safetensors" in str(e.value) and "lm_head.weight" in str(e.value)


def test_another_push_supersedes_the_wait() -> None:
    script = Scripted([rollout("RollingOut", "step-2", []), rollout("RollingOut", "step-3", [])])
    with gateway(script) as url, pytest.raises(RolloutSuperseded, match="now 'step-3'"):
        Pool(url, ADMIN, poll_interval_s=0).push("/ckpt/step-2", "step-2", progress=False)


def test_a_refused_push_raises_with_the_field_and_the_cli_exits_2() -> None:
    err = (400, {"error": {"category": "invalid_request", "field": "checkpoint",
                           "message": "checkpoint '/etc' is outside the pool's checkpoints.allowedRoots"}})
    script = Scripted([rollout("Complete", "step-1", [])], push_error=err)
    with gateway(script) as url:
        with pytest.raises(RequestRefused) as e:
            Pool(url, ADMIN).push("/etc", "x", progress=False)
        assert (e.value.status, e.value.field) == (400, "checkpoint") and "allowedRoots" in str(e.value)
        assert cli(["push", url, "--checkpoint", "/etc", "--label", "x", "--admin-key", ADMIN]) == 2
    assert script.gets == 0  # nothing waited for


def test_cli_push_wait_and_status(capsys: pytest.CaptureFixture[str]) -> None:
    script = Scripted([rollout("Complete", "step-2", [replica("w-0", "Updated", "step-2")], updated=2)])
    with gateway(script) as url:
        assert cli(["push", url, "--checkpoint", "/ckpt/step-2", "--label", "step-2", "--step", "2", "--wait",
                    "--admin-key", ADMIN]) == 0
        assert json.loads(capsys.readouterr().out)["state"] == "Complete"
        assert cli(["status", url, "--admin-key", ADMIN]) == 0
        assert json.loads(capsys.readouterr().out)["target_label"] == "step-2"
    assert script.pushes[0][1]["step"] == 2


def test_progress_lines_are_pure() -> None:
    a = Rollout.from_json(rollout("RollingOut", "s", [replica("w-0", "Updating", "o")]))
    assert progress_lines(a, a) == []
    b = Rollout.from_json(rollout("RollingOut", "s", [replica("w-0", "Updated", "s")], updated=1))
    assert progress_lines(a, b) == ["w-0: Updated (phase Ready, serving s)"]


PUSHED: dict[str, Any] = {"run": "math-rl", "step": 120, "version_label": "step-120", "model": "math-rl@120",
          "model_path": "tinker://math-rl/sampler_weights/step-120", "engine_name": "math-rl.120.7",
          "servable": "one"}


def test_push_adapter_sends_the_version_and_returns_it_typed() -> None:
    script = Scripted([], adapter_reply=(200, PUSHED))
    with gateway(script) as url:
        pool = Pool(url, ADMIN)
        done = pool.push_adapter("math-rl", "/ckpt/math-rl/120", "step-120", 120)
        assert done == AdapterPushed(**PUSHED)
        pool.push_adapter("math-rl", "/ckpt/math-rl/120", "step-120", 120, sha256_manifest={"a": "0" * 64},
                          pinned=True, servable="all")
    assert script.pushes == [
        (ADMIN, {"run": "math-rl", "path": "/ckpt/math-rl/120", "version_label": "step-120", "step": 120}),
        (ADMIN, {"run": "math-rl", "path": "/ckpt/math-rl/120", "version_label": "step-120", "step": 120,
                 "sha256_manifest": {"a": "0" * 64}, "pinned": True, "servable": "all"})]


def test_a_refused_adapter_push_raises_with_the_field_and_the_cli_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    err = (409, {"error": {"category": "conflict", "field": "step",
                           "message": "step 3 of run 'math-rl' is not newer than its newest version, step 4"}})
    script = Scripted([], adapter_reply=err)
    with gateway(script) as url:
        with pytest.raises(RequestRefused) as e:
            Pool(url, ADMIN).push_adapter("math-rl", "/ckpt/m/3", "step-3", 3)
        assert (e.value.status, e.value.field) == (409, "step") and "not newer" in str(e.value)
        argv = ["push-adapter", url, "--admin-key", ADMIN, "--run", "math-rl", "--path", "/ckpt/m/3",
                "--label", "step-3", "--step", "3"]
        assert cli(argv) == 2
        assert "409 conflict (step)" in capsys.readouterr().err


def test_an_adapter_push_answered_503_or_429_is_sent_again_until_it_lands_or_times_out() -> None:
    busy = (503, {"error": {"category": "no_replica", "message": "the replicas' adapters kept changing; push again"}})
    full = (429, {"error": {"category": "overloaded", "message": "busy", "field": "flow"}})
    script = Scripted([], adapter_reply=(200, PUSHED), adapter_first=[busy, full, busy])
    with gateway(script) as url:
        assert Pool(url, ADMIN).push_adapter("math-rl", "/ckpt/m/120", "step-120", 120) == AdapterPushed(**PUSHED)
    assert len(script.pushes) == 4 and all(b == script.pushes[0][1] for _, b in script.pushes)
    # Past the timeout the last 503 is raised, as the gateway said it.
    script = Scripted([], adapter_reply=busy)
    with gateway(script) as url:
        with pytest.raises(RequestRefused) as e:
            Pool(url, ADMIN).push_adapter("math-rl", "/ckpt/m/120", "step-120", 120, timeout=0.5)
    assert e.value.status == 503 and e.value.transient and "push again" in e.value.message
    assert len(script.pushes) == 1   # its Retry-After (none: 1 s) would pass the deadline
    # Gateways behind past their Lease bound: raised at once (the next moment would not differ).
    behind = (503, {"error": {"category": "unavailable", "field": "gateways", "message": "gw-b did not say"}})
    script = Scripted([], adapter_reply=(200, PUSHED), adapter_first=[behind])
    with gateway(script) as url:
        with pytest.raises(RequestRefused) as e:
            Pool(url, ADMIN).push_adapter("math-rl", "/ckpt/m/120", "step-120", 120)
    assert (e.value.field, e.value.transient, len(script.pushes)) == ("gateways", False, 1)


def test_cli_push_adapter(capsys: pytest.CaptureFixture[str]) -> None:
    script = Scripted([], adapter_reply=(200, {**PUSHED, "servable": "all"}))
    with gateway(script) as url:
        assert cli(["push-adapter", url, "--admin-key", ADMIN, "--run", "math-rl", "--path", "/ckpt/math-rl/120",
                    "--label", "step-120", "--step", "120", "--servable", "all", "--pinned"]) == 0
    assert json.loads(capsys.readouterr().out) == {**PUSHED, "servable": "all"}
    assert script.pushes == [(ADMIN, {"run": "math-rl", "path": "/ckpt/math-rl/120", "version_label": "step-120",
                                      "step": 120, "pinned": True, "servable": "all"})]
