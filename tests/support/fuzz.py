"""Property-based fuzzing of a running server from its committed OpenAPI spec (docs/openapi.json).

Schemathesis turns each operation of the spec into Hypothesis strategies: POSITIVE cases fit the
schema (and then meet the server's own checks: vocabulary, context length, limits), NEGATIVE cases
break it on purpose (wrong types, missing fields, out-of-range values, bad path parameters).
Every case is sent over real HTTP; what counts is the server's side: no 5xx, no dropped connection.
Generation is derandomized, so a run is reproducible and a failure can be replayed.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

import hypothesis
import requests
import schemathesis
from hypothesis import HealthCheck
from schemathesis.generation.modes import GenerationMode

from sampler_pod.http.openapi import SPEC_PATH


@dataclass
class FuzzFigures:
    requests: int = 0
    by_status: collections.Counter[int] = field(default_factory=collections.Counter)
    by_operation: collections.Counter[str] = field(default_factory=collections.Counter)
    server_errors: list[str] = field(default_factory=list)  # "<status> <op> <body excerpt>"
    dropped: list[str] = field(default_factory=list)  # transport errors: the server went away mid-request

    def summary(self) -> str:
        statuses = ", ".join(f"{s}: {n}" for s, n in sorted(self.by_status.items()))
        return (f"fuzz: {self.requests} requests over {len(self.by_operation)} operations; "
                f"5xx: {len(self.server_errors)}; dropped connections: {len(self.dropped)}; by status: {statuses}")


def _without_timeouts(case: Any) -> Any:
    # A request's own tiny `timeout_s` makes a 504 the right answer; that is tested elsewhere. Here a
    # 5xx must mean a server fault, so the fuzzer does not set deadlines.
    if isinstance(case.body, dict):
        case.body.pop("timeout_s", None)
    return case


def fuzz(base_url: str, examples_per_operation: int, timeout_s: float = 120.0,
         spec: dict[str, Any] | None = None, headers: dict[str, str] | None = None,
         examples_for: dict[str, int] | None = None) -> FuzzFigures:
    """`spec`: an OpenAPI document to fuzz instead of the committed one (vLLM's OpenAI routes).
    `examples_for`: another count for some operations ("POST /path"), for a schema whose cases cost
    Hypothesis much more to generate than the server to answer."""
    schema = schemathesis.openapi.from_path(SPEC_PATH) if spec is None else schemathesis.openapi.from_dict(spec)
    figures = FuzzFigures()
    session = requests.Session()
    session.headers.update(headers or {})
    operations = [r.ok() for r in schema.get_all_operations()]
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
        for op in operations:
            try:
                examples = (examples_for or {}).get(f"{op.method.upper()} {op.path}", examples_per_operation)
                _fuzz_operation(op, mode, base_url, session, figures, examples, timeout_s)
            except hypothesis.errors.Unsatisfiable:
                pass  # NEGATIVE mode for an operation with nothing to break (no parameters, no body)
    return figures


def _fuzz_operation(op: Any, mode: GenerationMode, base_url: str, session: requests.Session, figures: FuzzFigures,
                    examples: int, timeout_s: float) -> None:
    label = f"{op.method.upper()} {op.path}"

    @hypothesis.settings(max_examples=examples, derandomize=True, database=None, deadline=None,
                         suppress_health_check=list(HealthCheck),
                         phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate])
    @hypothesis.given(case=op.as_strategy(generation_mode=mode).map(_without_timeouts))
    def send(case: Any) -> None:
        figures.requests += 1
        figures.by_operation[label] += 1
        try:
            r = case.call(base_url=base_url, session=session, timeout=timeout_s)
        except requests.RequestException as e:
            figures.dropped.append(f"{label}: {type(e).__name__}: {e}")
            return
        figures.by_status[r.status_code] += 1
        if r.status_code >= 500:
            figures.server_errors.append(f"{r.status_code} {label} {case.body!r:.200} -> {r.text[:300]}")

    send()
