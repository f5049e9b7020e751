"""The malformed-request matrix: (case id, body, expected status, field the error must name)."""

from __future__ import annotations

from typing import Any

from sampler_pod.core.logprobs_mode import HEADER, MODES

GOOD: dict[str, Any] = {"prompts": [[1, 2, 3]], "sampling_params": {"max_tokens": 4}}


def _with(**kw: Any) -> dict[str, Any]:
    body = {"prompts": [[1, 2, 3]], "sampling_params": {"max_tokens": 4}}
    sp = kw.pop("sampling_params", None)
    if sp:
        body["sampling_params"] = {**body["sampling_params"], **sp}
    body.update(kw)
    return body


BAD_REQUESTS: list[tuple[str, Any, int, str]] = [
    ("token_outside_vocab", _with(prompts=[[1, 2, 10**6]]), 400, "prompts[0][2]"),
    ("negative_token", _with(prompts=[[1, -5]]), 400, "prompts[0][1]"),
    ("prompt_plus_max_tokens_over_max_model_len", _with(sampling_params={"max_tokens": 600}), 400,
     "sampling_params.max_tokens"),
    ("negative_temperature", _with(sampling_params={"temperature": -0.1}), 400, "sampling_params.temperature"),
    ("top_p_zero", _with(sampling_params={"top_p": 0.0}), 400, "sampling_params.top_p"),
    ("top_p_over_one", _with(sampling_params={"top_p": 1.5}), 400, "sampling_params.top_p"),
    ("num_samples_zero", _with(num_samples=0), 400, "num_samples"),
    ("num_samples_over_limit", _with(num_samples=10_000), 400, "num_samples"),
    ("empty_prompt", _with(prompts=[[]]), 400, "prompts"),
    ("no_prompts", _with(prompts=[]), 400, "prompts"),
    ("prompt_not_a_list", _with(prompts="hello"), 400, "prompts"),
    ("token_is_string", _with(prompts=[[1, "2"]]), 400, "prompts[0][1]"),
    ("max_tokens_is_string", _with(sampling_params={"max_tokens": "many"}), 400, "sampling_params.max_tokens"),
    ("unknown_field", _with(bogus=1), 400, "bogus"),
    ("timeout_over_max", _with(timeout_s=10**7), 400, "timeout_s"),
    ("unknown_adapter", _with(adapter="nope"), 400, "adapter"),
    ("body_over_limit", {"prompts": [[1] * 5_000_000]}, 413, "body"),
    # A mode the replica does not serve (every test server serves raw_logprobs unless it says otherwise).
    ("logprobs_mode_not_served", _with(logprobs_mode="processed_logprobs"), 400, "logprobs_mode"),
    ("logprobs_mode_unknown", _with(logprobs_mode="softmax"), 400, "logprobs_mode"),
]


def mode_mismatches(served: str) -> list[tuple[str, Any, dict[str, str], int, str]]:
    """Requests that ask a replica serving logprobs mode `served` for logprobs of another kind:
    (case id, body, headers, expected status, field the error must name). Prompt logprobs under sampling
    processing are of another kind on a processed_* replica (core/logprobs_mode.py)."""
    other = next(m for m in MODES if m != served)
    cases: list[tuple[str, Any, dict[str, str], int, str]] = [
        ("body_names_another_mode", _with(logprobs_mode=other), {}, 400, "logprobs_mode"),
        ("header_names_another_mode", GOOD, {HEADER: other}, 400, HEADER),
        ("header_names_no_mode", GOOD, {HEADER: "softmax"}, 400, HEADER),
    ]
    if served.startswith("processed_"):
        cases += [
            ("prompt_logprobs_at_temperature_0_7", _with(sampling_params={"temperature": 0.7, "prompt_logprobs": True}),
             {}, 400, "sampling_params.prompt_logprobs"),
            ("prompt_logprobs_under_top_p", _with(sampling_params={"top_p": 0.9, "prompt_logprobs": True}),
             {}, 400, "sampling_params.prompt_logprobs"),
            ("topk_prompt_logprobs_under_top_k", _with(sampling_params={"top_k": 20, "topk_prompt_logprobs": 3}),
             {}, 400, "sampling_params.topk_prompt_logprobs"),
        ]
    return cases


# vLLM's weight-transfer control calls on a replica with --weight-transfer-backend gloo, sent in order to a
# replica no trainer has joined (tests run `POST /shutdown_weight_transfer_engine` first): (case id, path,
# body, expected status, field the error must name). Nothing of them joins or receives anything.
INIT = {"master_address": "127.0.0.1", "master_port": 29400, "world_size": 2}
UPDATE = {"names": ["lm_head.weight"], "dtype_names": ["float32"], "shapes": [[512, 128]]}
BAD_TRANSFER_REQUESTS: list[tuple[str, str, Any, int, str]] = [
    ("unknown_backend", "/init_weight_transfer_engine", {"init_info": {**INIT, "backend": "nccl"}}, 400,
     "init_info.backend"),
    ("nccl_init_info_without_a_backend", "/init_weight_transfer_engine",
     {"init_info": {**INIT, "rank_offset": 1, "packed": True, "packed_num_buffers": 2}}, 400, "init_info.backend"),
    ("world_size_without_room_for_the_replica", "/init_weight_transfer_engine",
     {"init_info": {**INIT, "rank_offset": 2}}, 400, "init_info.world_size"),
    ("world_size_of_one", "/init_weight_transfer_engine", {"init_info": {**INIT, "world_size": 1}}, 400,
     "init_info.world_size"),
    ("rank_offset_zero", "/init_weight_transfer_engine", {"init_info": {**INIT, "rank_offset": 0}}, 400,
     "init_info.rank_offset"),
    ("unknown_init_field", "/init_weight_transfer_engine", {"init_info": {**INIT, "bogus": 1}}, 400,
     "init_info.bogus"),
    ("port_out_of_range", "/init_weight_transfer_engine", {"init_info": {**INIT, "master_port": 70000}}, 400,
     "init_info.master_port"),
    ("no_init_info", "/init_weight_transfer_engine", {}, 400, "init_info"),
    ("start_before_init", "/start_weight_update", None, 409, "start_weight_update"),
    ("update_before_start", "/update_weights", {"update_info": UPDATE}, 409, "update_weights"),
    ("finish_before_update", "/finish_weight_update", {"weight_version": "v1"}, 409, "finish_weight_update"),
    ("finish_without_a_body_before_update", "/finish_weight_update", None, 409, "finish_weight_update"),
    ("sha256_not_hex", "/update_weights", {"update_info": {**UPDATE, "sha256": "z" * 64}}, 400,
     "update_info.sha256"),
    ("sha256_too_short", "/update_weights", {"update_info": {**UPDATE, "sha256": "ab12"}}, 400,
     "update_info.sha256"),
    ("lists_of_different_lengths", "/update_weights", {"update_info": {**UPDATE, "shapes": []}}, 400, "update_info"),
    ("per_rank_update_info_list", "/update_weights", {"update_info": [UPDATE]}, 400, "update_info"),
    ("in_flight_unknown", "/update_weights", {"update_info": {**UPDATE, "in_flight": "later"}}, 400,
     "update_info.in_flight"),
    ("weight_version_empty", "/finish_weight_update", {"weight_version": ""}, 400, "weight_version"),
]


# Through a pool's gateway (its own checks, then the replicas'): (case id, path, body, the phase the push is
# brought to first, expected status, field the error must name). `{"update_info": "TINY", "extra": {...}}`
# stands for an update that fits the tiny model, with `extra` on top.
BAD_GATEWAY_TRANSFER_REQUESTS: list[tuple[str, str, Any, str, int, str]] = [
    ("world_size_not_the_pools", "/init_weight_transfer_engine", {"init_info": {**INIT, "world_size": 3}}, "idle",
     400, "init_info.world_size"),
    ("rank_offset_not_the_trainers", "/init_weight_transfer_engine",
     {"init_info": {**INIT, "world_size": 4, "rank_offset": 2}}, "idle", 400, "init_info.rank_offset"),
    ("unknown_backend", "/init_weight_transfer_engine", {"init_info": {**INIT, "world_size": 4, "backend": "nccl"}},
     "idle", 400, "init_info.backend"),
    ("no_init_info", "/init_weight_transfer_engine", {}, "idle", 400, "init_info"),
    ("port_out_of_range", "/init_weight_transfer_engine",
     {"init_info": {**INIT, "world_size": 4, "master_port": 70000}}, "idle", 400, "init_info.master_port"),
    ("start_before_init", "/start_weight_update", None, "idle", 409, "start_weight_update"),
    ("update_before_start", "/update_weights", {"update_info": "TINY"}, "joined", 409, "update_weights"),
    ("finish_before_update", "/finish_weight_update", {"weight_version": "v1"}, "started", 409,
     "finish_weight_update"),
    ("sha256_not_hex", "/update_weights", {"update_info": "TINY", "extra": {"sha256": "z" * 64}}, "started", 400,
     "update_info.sha256"),
    ("in_flight_unknown", "/update_weights", {"update_info": "TINY", "extra": {"in_flight": "later"}}, "started",
     400, "update_info.in_flight"),
    ("a_tensor_the_model_has_not", "/update_weights", {"update_info": "TINY", "extra": {"names": ["x"],
                                                                                       "dtype_names": ["float32"],
                                                                                       "shapes": [[1]]}},
     "started", 400, "update_info.names[0]"),
    ("weight_version_empty", "/finish_weight_update", {"weight_version": ""}, "idle", 400, "weight_version"),
]
