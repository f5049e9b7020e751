"""Test seams stay out of real clusters. Pure.

The sampler's `--enable-test-seams` lets a load fail midway on purpose (`test_fail_after_tensors`)
and a start hang (`--test-hang-startup`): what the node tier and the demo need to show a
replacement, and what no production replica may ever run (a copied test manifest would let any
admin-key holder break a replica's weights at will). So the operator refuses a SamplerReplica that
turns them on, unless the operator itself allows it: `SAMPLER_OPERATOR_ALLOW_TEST_SEAMS` (chart value
`allowTestSeams`), off by default. A refused replica gets no pod: `phase: Invalid`,
`SpecValid=False` with reason `TestSeamsNotAllowed`, and a Warning Event.

Every way the sampler would take the flag is caught: in `spec.engineArgs.extraArgs` or a
`spec.pod.command` override, as `--enable-test-seams`, `--enable-test-seams=...` or any prefix
argparse accepts for it (`--enable-t...`), also inside a shell command line; and in the environment,
`SAMPLER_ENABLE_TEST_SEAMS` in `spec.pod.env` (a `valueFrom` counts: its value is unknown here).
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from sampler_operator.replica.spec import InvalidSpec, SamplerReplicaSpec

FLAG = "--enable-test-seams"
ENV = "SAMPLER_ENABLE_TEST_SEAMS"
SETTING = "SAMPLER_OPERATOR_ALLOW_TEST_SEAMS"
REASON = "TestSeamsNotAllowed"
# argparse takes any unambiguous prefix of a long flag (allow_abbrev). The sampler's only other flag
# starting with `--enable-` is `--enable-lora`, so `--enable-t` is the shortest that means the seams.
_SHORTEST_PREFIX = "--enable-t"
# What the sampler reads as "on" from its environment (sampler_pod/config.py::_from_env).
_TRUE = {"1", "true", "yes", "on"}


def _is_flag(word: str) -> bool:
    name = word.split("=", 1)[0]
    return len(name) >= len(_SHORTEST_PREFIX) and FLAG.startswith(name)


def _env_on(var: Mapping[str, Any]) -> bool:
    if var.get("valueFrom") is not None:
        return True
    return str(var.get("value") or "").strip().lower() in _TRUE


def requested(spec: SamplerReplicaSpec) -> Iterator[str]:
    """Where the spec turns the test seams on, one field path per finding."""
    for field, tokens in (("spec.engineArgs.extraArgs", spec.engine_args.extra_args),
                          ("spec.pod.command", spec.pod.command)):
        for i, token in enumerate(tokens):
            if any(_is_flag(word) for word in token.split()):   # also `sh -c "... --enable-test-seams"`
                yield f"{field}[{i}] {token!r}"
    for i, var in enumerate(spec.pod.env):
        if var.get("name") == ENV and _env_on(var):
            yield f"spec.pod.env[{i}] {ENV}"


def check(spec: SamplerReplicaSpec, allowed: bool) -> None:
    """Raise InvalidSpec (reason TestSeamsNotAllowed) for a spec with test seams the operator does not allow."""
    found = list(requested(spec))
    if found and not allowed:
        raise InvalidSpec(f"{', '.join(found)} enables the sampler's test seams ({FLAG}), which this operator "
                          f"does not allow: test clusters only, with {SETTING}=true (chart value allowTestSeams)",
                          reason=REASON)
