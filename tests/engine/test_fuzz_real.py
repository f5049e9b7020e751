"""Issue #10: generated requests (docs/openapi.json -> schemathesis) against the REAL engine.

Every operation of the spec, schema-valid and schema-breaking cases: the server must answer each
with a non-5xx status over a connection it keeps, and be healthy, idle and consistent afterwards.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from tests.support.fuzz import fuzz
from tests.support.metrics import total
from tests.support.server import run_server

# 12 operations take a body and 3 a path parameter; at 40 examples each, per mode, a run sends
# about 1,200 requests (Hypothesis stops early on operations whose cases it has exhausted).
EXAMPLES_PER_OPERATION = 40


def test_fuzzed_requests_get_no_5xx_and_leave_the_server_healthy(tiny_model: Path, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    report: list[str] = []  # the figures, printed even when pytest captures output
    root = tmp_path / "checkpoints"
    root.mkdir()
    # An empty checkpoint root, so loads and adapter adds reach validation (and fail there).
    # Small caps keep the schema-valid samples cheap on a CPU engine. A processed logprobs mode: the
    # spec's logprobs_mode (body) and X-Sampler-Logprobs-Mode (header) values then ask for modes it does
    # not serve, prompt logprobs under sampling processing are refused, and alternatives top-k and top-p
    # mask out (-inf) meet the JSON encoder: all must be 4xx or answers, never a 5xx.
    args = ["--checkpoint-root", str(root), "--enable-lora", "--max-num-samples", "4",
            "--max-inflight-sequences", "64", "--logprobs-mode", "processed_logprobs"]
    with run_server(tiny_model, *args) as server:
        t0 = time.monotonic()
        figures = fuzz(server.url, EXAMPLES_PER_OPERATION)
        took = time.monotonic() - t0
        report.append(f"\n{figures.summary()}; {took:.0f}s")
        with httpx.Client(base_url=server.url, timeout=30) as c:
            deadline = time.monotonic() + 60
            while (h := c.get("/health").json())["in_flight"]:
                assert time.monotonic() < deadline, h
                time.sleep(0.1)
            fuzz_admitted = total(c.get("/metrics").text, "sampler_requests_admitted_total")
            health = c.get("/health")
            # The engine path still works after the fuzz (schema-valid fuzz cases rarely pass the
            # server's own checks, so this request, not the fuzz, is what proves it).
            sample = c.post("/v1/sample", json={"prompts": [[1, 2, 3]], "sampling_params": {"max_tokens": 4}})
            metrics = c.get("/metrics").text
        admitted = total(metrics, "sampler_requests_admitted_total")
        finished = total(metrics, "sampler_requests_finished_total")
        report.append(f"after: health {health.json()['status']}, in flight 0, admitted by the fuzz "
                      f"{fuzz_admitted:.0f}, admitted {admitted:.0f} = finished {finished:.0f} with the check sample, "
                      f"server log lines with Traceback: {server.log().count('Traceback')}")
    with capsys.disabled():
        print("\n".join(report))
    assert figures.requests >= 1000, figures.summary()
    assert not figures.server_errors, "\n".join(figures.server_errors[:20])
    assert not figures.dropped, "\n".join(figures.dropped[:20])
    assert health.status_code == 200 and health.json()["status"] == "ok", health.text
    assert sample.status_code == 200, sample.text
    assert admitted == finished == fuzz_admitted + 1
