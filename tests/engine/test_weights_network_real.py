"""Issue #51 (phase A) on the REAL vLLM engine: a trainer process pushes weights over the network into one
replica with vLLM's weight-transfer protocol over gloo (docs/design/weights-over-network.md).

One replica for the module (the engine start is the slow part), with both keys and the test seams; one
trainer process holding Hugging Face models serves most pushes (tests/support/trainer.py). Checked against
Hugging Face (greedy tokens, prompt logprobs) and against digests computed from the checkpoint files.
Nothing here sleeps: tests wait on the trainer's answers and on the replica's /health.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support import REPO_ROOT
from tests.support.bad_requests import BAD_TRANSFER_REQUESTS, GOOD
from tests.support.checkpoints import hf_greedy, hf_prompt_logprobs, perturbed_checkpoint
from tests.support.inflight import N, assert_continued, freeze_mid_generation, retrieve, submit_all
from tests.support.metrics import metric
from tests.support.network_push import (
    START_TIMEOUT_S,
    TrainerProcess,
    checkpoint_sha256,
    greedy,
    health,
    trainer_process,
    transfers,
)
from tests.support.server import RunningServer, run_server, wait_until

KEY, ADMIN = "tml-sample-net", "tml-admin-net"
PROMPT = [1, 17, 42, 99, 123, 7, 250, 31]
# Small chunks, so a push of the tiny model (1.8 MB) is many broadcasts and can be cut in the middle.
CHUNK = 64 << 10
TENSOR = "model.layers.0.self_attn.q_proj.weight"


@dataclass
class Env:
    server: RunningServer
    model: Path
    root: Path
    trainer: TrainerProcess

    def client(self) -> httpx.Client:
        return self.server.client(headers={"X-API-Key": ADMIN})


@pytest.fixture(scope="module")
def env(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    root = tmp_path_factory.mktemp("network") / "checkpoints"
    for step in (1, 2, 3, 4, 5):
        perturbed_checkpoint(tiny_model, root / f"step-{step}", seed=50 + step)
    with run_server(tiny_model, "--weight-transfer-backend", "gloo", "--enable-test-seams",
                    "--api-key", KEY, "--admin-api-key", ADMIN) as server, \
            trainer_process(server.url, ADMIN, packed_buffer_size_bytes=CHUNK) as trainer:
        yield Env(server, tiny_model, root, trainer)


def prompt_logprobs(c: httpx.Client) -> list[float]:
    r = c.post("/v1/sample", json={"prompts": [PROMPT], "sampling_params": {"max_tokens": 1, "prompt_logprobs": True}})
    assert r.status_code == 200, r.text
    lps: list[float] = r.json()["results"][0]["prompt_logprobs"][1:]
    return lps


def test_a_trainer_process_pushes_a_hugging_face_model_and_greedy_output_equals_hugging_faces(env: Env) -> None:
    first, second = env.root / "step-1", env.root / "step-2"
    with env.client() as c:
        before = health(c)
        out = env.trainer.push(first, label="net-1", step=1)
        assert out["ok"], out
        h = health(c)
        got_tokens, got_lps = greedy(c, PROMPT), prompt_logprobs(c)
        # A second push of other weights, over the same group (no new init).
        out2 = env.trainer.push(second, label="net-2", step=2, in_flight="abort")
        h2 = health(c)
        second_tokens = greedy(c, PROMPT)
    digest = checkpoint_sha256(first)
    assert out["result"]["sha256"] == digest and out["result"]["tensors"] == 21, out
    assert h["status"] == "ok" and h["weights_label"] == "net-1" and h["weights_step"] == 1, h
    assert h["weights_version"] == before["weights_version"] + 1 and h["weights_sha256"] == digest, h
    assert h["intended"] == {"checkpoint": None, "version_label": "net-1", "sha256_manifest": None, "step": 1,
                             "sha256": digest}, h
    assert h["weight_transfer"]["phase"] == "joined", h
    assert got_tokens == hf_greedy(first, PROMPT, 16)
    ref = hf_prompt_logprobs(first, PROMPT)
    assert max(abs(a - b) for a, b in zip(got_lps, ref, strict=True)) < 1e-3, (got_lps, ref)
    assert out2["ok"] and out2["result"]["sha256"] == checkpoint_sha256(second), out2
    assert h2["weights_label"] == "net-2" and h2["weights_version"] == h["weights_version"] + 1, h2
    assert second_tokens == hf_greedy(second, PROMPT, 16) != got_tokens


@pytest.mark.parametrize("how,field,why", [
    ("rename", r"update_info\.names\[\d+\]", "is not a tensor of the served model"),
    ("reshape", r"update_info\.shapes\[\d+\]", "has shape"),
    ("cast", r"update_info\.dtype_names\[\d+\]", "has dtype 'float16'"),
    ("digest", r"update_info", "sha256"),
])
def test_a_wrong_name_shape_dtype_or_digest_is_refused_before_any_write_naming_the_tensor(
        env: Env, how: str, field: str, why: str) -> None:
    with env.client() as c:
        before, lps, refused = health(c), prompt_logprobs(c), transfers(c, "refused")
        out = env.trainer.push(env.root / "step-3", label=f"bad-{how}", tamper={how: TENSOR})
        after = health(c)
        assert prompt_logprobs(c) == lps  # bit-identical: not a byte was written
        assert transfers(c, "refused") == refused + 1
    assert not out["ok"], out
    err = out["error"]
    assert err["status"] == 400 and err["category"] == "invalid_checkpoint" and re.fullmatch(field, err["field"]), err
    assert TENSOR in err["message"] and why in err["message"], err
    assert after["status"] == "ok" and after["weight_transfer"] is None, after  # it left the group
    assert (after["weights_label"], after["weights_version"]) == (before["weights_label"], before["weights_version"])


def test_a_trainer_killed_mid_transfer_leaves_the_replica_ready_at_its_old_label_and_the_next_push_works(
        env: Env) -> None:
    with env.client() as c:
        # Two pushes written first: the doomed one then lands in the block of the first of them, which the
        # replica keeps for the next push once the second is written (its kept copy then the second's).
        for step in (1, 3):
            out = env.trainer.push(env.root / f"step-{step}", label=f"net-{step}-again", step=step)
            assert out["ok"], out
        before, tokens, torn = health(c), greedy(c, PROMPT), transfers(c, "torn")
        assert tokens == hf_greedy(env.root / "step-3", PROMPT, 16)
        with trainer_process(env.server.url, ADMIN, packed_buffer_size_bytes=CHUNK) as doomed:
            doomed.send(checkpoint=str(env.root / "step-4"), label="never", stall_after=10)
            assert doomed.next() == {"stalled": True}

            def receiving() -> bool:
                t = health(c)["weight_transfer"]
                return t is not None and t["phase"] == "receiving" and 0 < t["bytes_received"] < t["total_bytes"]

            wait_until(receiving, "the push half received", timeout=60)
            doomed.kill()
        wait_until(lambda: health(c)["weight_transfer"] is None, "the replica to leave the torn group", timeout=60)
        after = health(c)
        assert after["status"] == "ok" and c.get("/readyz").status_code == 200, after
        assert (after["weights_label"], after["weights_version"]) == (before["weights_label"],
                                                                       before["weights_version"])
        assert after["intended"] == before["intended"]
        assert greedy(c, PROMPT) == tokens
        assert transfers(c, "torn") == torn + 1
        # The module's trainer was in the group the killed one replaced: its push joins again by itself.
        out = env.trainer.push(env.root / "step-4", label="net-4", step=4)
        assert out["ok"], out
        assert health(c)["weights_label"] == "net-4"
        assert greedy(c, PROMPT) == hf_greedy(env.root / "step-4", PROMPT, 16)


def test_a_keep_push_with_16_samples_in_flight_loses_none_and_their_spans_are_exact(env: Env) -> None:
    with env.client() as c:
        old = health(c)
        rids = submit_all(c)
        counts = freeze_mid_generation(c, rids)  # every sample mid-generation, the engine frozen
        ok_before = metric(c.get("/metrics").text, "sampler_requests_finished_total", 0.0, outcome="ok")

        # The push is received while the engine is frozen, then written under keep (which resumes it):
        # a push that waited for these samples would never end.
        out = env.trainer.push(env.root / "step-5", label="net-5", step=5, in_flight="keep")
        assert out["ok"], out
        answers = {rid: retrieve(c, rid) for rid in rids}
        text = c.get("/metrics").text
    assert_continued(answers, counts, (old["weights_label"], old["weights_version"]),
                     ("net-5", old["weights_version"] + 1))
    assert metric(text, "sampler_requests_finished_total", outcome="ok") == ok_before + N  # 0 lost
    assert metric(text, "sampler_requests_in_flight") == 0


def test_a_plain_vllm_trainer_api_script_works_unchanged_but_for_one_import(env: Env) -> None:
    checkpoint = env.root / "step-3"
    url = env.server.url.replace("http://", f"http://trainer:{ADMIN}@")  # the key as HTTP Basic's password
    out = subprocess.run([sys.executable, str(REPO_ROOT / "tests/support/plain_vllm_trainer.py"), url,
                          str(checkpoint)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=START_TIMEOUT_S)
    assert out.returncode == 0 and '{"done": true}' in out.stdout, out.stderr[-4000:]
    digest = checkpoint_sha256(checkpoint)
    with env.client() as c:
        h = health(c)
        tokens = greedy(c, PROMPT)
    # No weight_version: the label is made of the digest; drained (the default), step unknown.
    assert h["weights_label"] == f"sha256-{digest[:16]}" and h["weights_sha256"] == digest, h
    assert h["weights_step"] is None
    assert tokens == hf_greedy(checkpoint, PROMPT, 16)


@pytest.mark.parametrize("case,path,body,status,field", BAD_TRANSFER_REQUESTS,
                         ids=[c[0] for c in BAD_TRANSFER_REQUESTS])
def test_bad_control_calls_get_a_4xx_naming_the_field_and_lose_nothing(env: Env, case: str, path: str, body: Any,
                                                                      status: int, field: str) -> None:
    with env.client() as c:
        assert c.post("/shutdown_weight_transfer_engine").status_code == 200  # no trainer joined
        before = health(c)
        r = c.post(path, json=body) if body is not None else c.post(path)
        assert r.status_code == status, r.text
        assert r.json()["error"]["field"] == field, r.text
        after = health(c)
        assert after["status"] == "ok" and after["weights_version"] == before["weights_version"], after
        assert c.post("/v1/sample", json=GOOD).status_code == 200


def test_a_push_without_the_admin_key_is_refused(env: Env) -> None:
    with env.server.client() as anonymous, env.server.client(headers={"X-API-Key": KEY}) as sampler:
        for path in ("/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
                     "/finish_weight_update", "/shutdown_weight_transfer_engine"):
            r = anonymous.post(path, json={})
            assert r.status_code == 401 and "X-API-Key" in r.json()["error"]["message"], (path, r.text)
            r = sampler.post(path, json={})
            assert r.status_code == 403 and "--admin-api-key" in r.json()["error"]["message"], (path, r.text)
        assert sampler.get("/get_world_size").json() == {"world_size": 1}
