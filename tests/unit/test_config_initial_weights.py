"""The startup-weights flags: parsed from flags and environment alike, refused with the flag named."""

from __future__ import annotations

import pytest

from sampler_pod.config import InitialAdapter, parse_config


def parse_error(capsys: pytest.CaptureFixture[str], argv: list[str], environ: dict[str, str] | None = None) -> str:
    with pytest.raises(SystemExit) as e:
        parse_config(["--model", "m", *argv], environ=environ or {})
    assert e.value.code == 2
    return capsys.readouterr().err


def test_initial_weights_from_flags_and_from_env() -> None:
    flags = parse_config(["--model", "m", "--checkpoint-root", "/ck", "--enable-lora",
                          "--initial-checkpoint", "step-2", "--initial-version-label", "step-2",
                          "--initial-sha256-manifest", '{"model.safetensors": "ab"}',
                          "--initial-adapters", '[{"name": "policy", "path": "lora-a"}]'], environ={})
    env = parse_config(["--model", "m"], environ={
        "SAMPLER_CHECKPOINT_ROOTS": "/ck", "SAMPLER_ENABLE_LORA": "1",
        "SAMPLER_INITIAL_CHECKPOINT": "step-2", "SAMPLER_INITIAL_VERSION_LABEL": "step-2",
        "SAMPLER_INITIAL_SHA256_MANIFEST": '{"model.safetensors": "ab"}',
        "SAMPLER_INITIAL_ADAPTERS": '[{"name": "policy", "path": "lora-a"}]'})
    for cfg in (flags, env):
        assert cfg.initial_checkpoint == "step-2" and cfg.initial_version_label == "step-2"
        assert cfg.initial_sha256_manifest == {"model.safetensors": "ab"}
        assert cfg.initial_adapters == [InitialAdapter(name="policy", path="lora-a")]
    step = parse_config(["--model", "m", "--checkpoint-root", "/ck", "--initial-checkpoint", "s",
                         "--initial-version-label", "s"], environ={"SAMPLER_INITIAL_STEP": "7"})
    assert step.initial_step == 7  # #24: a replacement pod's step, as the operator passes it
    defaults = parse_config(["--model", "m"], environ={})
    assert defaults.initial_checkpoint is None and defaults.initial_adapters is None
    assert defaults.weights_state_path is None  # no state file unless asked for (issue #23)
    assert defaults.write_timeout_s == 600 and not defaults.test_hang_startup


@pytest.mark.parametrize(("argv", "message"), [
    (["--checkpoint-root", "/ck", "--initial-checkpoint", "step-2"], "--initial-version-label"),
    (["--checkpoint-root", "/ck", "--initial-version-label", "step-2"], "--initial-checkpoint"),
    (["--initial-checkpoint", "s", "--initial-version-label", "s"], "--checkpoint-root"),
    (["--initial-sha256-manifest", '{"a": "b"}'], "--initial-sha256-manifest needs --initial-checkpoint"),
    (["--checkpoint-root", "/ck", "--initial-checkpoint", "s", "--initial-version-label", "s",
      "--initial-sha256-manifest", "{not json"], "--initial-sha256-manifest"),
    (["--checkpoint-root", "/ck", "--initial-adapters", '[{"name": "a", "path": "p"}]'], "--enable-lora"),
    (["--enable-lora", "--checkpoint-root", "/ck", "--initial-adapters", '[{"name": "a"}]'], "--initial-adapters"),
    (["--enable-lora", "--checkpoint-root", "/ck", "--initial-adapters", '[{"name": "a", "path": "p", "rank": 8}]'],
     "--initial-adapters"),
    (["--test-hang-startup"], "--test-hang-startup needs --enable-test-seams"),
    (["--initial-step", "3"], "--initial-step needs --initial-checkpoint"),
    (["--enable-lora", "--max-loras", "4", "--max-cpu-loras", "3"], "--max-cpu-loras (3) must be at least --max-loras"),
    (["--max-cpu-loras", "0"], "max-cpu-loras"),
    (["--enable-lora", "--checkpoint-root", "/ck", "--max-loras", "1", "--initial-adapters",
      '[{"name": "a", "path": "p"}, {"name": "b", "path": "q"}]'], "more than --max-cpu-loras (1)"),
    (["--checkpoint-root", "/ck", "--initial-checkpoint", "s", "--initial-version-label", "s",
      "--initial-step", "-1"], "initial-step"),
])
def test_bad_combinations_are_refused_naming_the_flag(capsys: pytest.CaptureFixture[str], argv: list[str],
                                                      message: str) -> None:
    assert message in parse_error(capsys, argv)


def test_an_adapter_entry_of_health_is_an_initial_adapter_as_it_stands() -> None:
    """The operator passes a replacement the adapters `/health` reported, entries whole."""
    entry = '[{"name": "a", "path": "/ck/a", "in_flight": 2, "last_used_at": "2026-01-01T00:00:00.000Z"}]'
    cfg = parse_config(["--model", "m", "--enable-lora", "--checkpoint-root", "/ck", "--initial-adapters", entry],
                       environ={})
    assert cfg.initial_adapters == [InitialAdapter(name="a", path="/ck/a")]


def test_hang_seam_is_accepted_with_the_seams_flag() -> None:
    cfg = parse_config(["--model", "m", "--enable-test-seams", "--test-hang-startup"], environ={})
    assert cfg.test_hang_startup and cfg.enable_test_seams
