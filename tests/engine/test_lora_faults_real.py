"""Issue #54, acceptance 1: a LoRA pool loses a replica under load and no request loses its answer.

The setup is tests/support/lora_faults.py's (also bench/faults_lora.py's): two real vLLM CPU replicas
with 2 LoRA slots each, 5 versions of 2 runs and the base model asked for by six closed-loop clients
across the native and OpenAI routes, one replica SIGKILLed once the load runs.

Must hold: every request answered 200 (none failed, on the kill's unloads, loads and samples, nor
while waiting for a slot on the survivor), and every answer's greedy tokens equal Hugging Face +
PEFT's for exactly the version its name resolves to (the base model's for the base model)."""

from __future__ import annotations

import collections
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.lora_faults import SURVIVOR, Stack, kill_under_load, lora_pool, tokens_of

BEFORE_KILL, AFTER_KILL = 60, 150  # answers: the load running, then the load on the survivor alone


@pytest.fixture(scope="module")
def stack(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with lora_pool(tiny_model, tmp_path_factory.mktemp("lora-faults")) as s:
        yield s


def test_a_replica_killed_under_lora_load_costs_no_request_its_answer(stack: Stack) -> None:
    run = kill_under_load(stack, BEFORE_KILL, AFTER_KILL)
    assert run.answered_before >= BEFORE_KILL
    everything = [(name, a) for name, got in run.answers.items() for a in got]
    failed = [(name, a.status, a.error) for name, a in everything if a.status != 200]
    statuses = collections.Counter(a.status for _, a in everything)
    assert not failed, (statuses, failed[:5])
    wrong = [(name, tokens_of(a)) for name, a in everything if tokens_of(a) != stack.want[name]]
    assert not wrong, (wrong[:5], stack.want)
    # The survivor took the load on alone: answers after the kill came from it, for every name.
    after = {name for name, a in everything if a.sent > run.killed_at and a.replica == SURVIVOR}
    assert after == set(run.answers), after
