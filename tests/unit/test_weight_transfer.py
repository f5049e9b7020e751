"""Issue #51 (phase A), the pure parts and the protocol's logic on the fake engine: the digests, how a push is
cut into chunks, the check of a push's tensors against the model, the order of the control calls, and the
routes (bad inputs, a torn or refused push, the write's modes, /health, a restart after a push). The bytes
themselves travel on the real engine: tests/engine/test_weights_network_real.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from sampler_common.weight_transfer.chunks import block_bytes, chunk_plan
from sampler_common.weight_transfer.digest import TensorRecord, is_hex_digest, model_sha256, records
from sampler_pod.core.sampler import SamplerCore
from sampler_pod.engine.fake import FakeEngine, FakeWeightReceiver
from sampler_pod.weights import validation as v
from sampler_pod.weights.transfer_session import ALLOWED, EXPECTS, TransferSession, out_of_order
from tests.support.bad_requests import BAD_TRANSFER_REQUESTS, GOOD
from tests.support.inproc import fake_client, fake_core, outcomes, until
from tests.support.metrics import metric
from tests.support.server import run_server

# ------------------------------------------------------------------------ digests


def test_the_model_digest_is_sha256_of_the_sorted_manifest_lines() -> None:
    a, b = hashlib.sha256(b"\x01\x02").hexdigest(), hashlib.sha256(b"").hexdigest()
    recs = [TensorRecord("z.weight", "bfloat16", (2, 3), a), TensorRecord("a.bias", "float32", (), b.upper())]
    manifest = f"a.bias\tfloat32\t\t{b}\nz.weight\tbfloat16\t2,3\t{a}\n"
    assert model_sha256(recs) == hashlib.sha256(manifest.encode()).hexdigest()
    assert model_sha256(reversed(recs)) == model_sha256(recs)  # the order of sending does not matter
    assert model_sha256(recs[:1]) != model_sha256(recs)
    assert records(["n"], ["float32"], [[4]], [b"\x00" * 32]) == [TensorRecord("n", "float32", (4,), "00" * 32)]
    assert is_hex_digest("ab" * 32) and is_hex_digest("AB" * 32)
    assert not is_hex_digest("ab" * 31) and not is_hex_digest("zz" * 32) and not is_hex_digest(None)


@pytest.mark.parametrize("sizes,buffer,chunks", [
    ([10, 10, 10], 15, [[0, 1], [2]]),     # a chunk closes once it holds MORE than the buffer
    ([10, 10, 10], 20, [[0, 1, 2]]),
    ([100, 1, 1], 15, [[0], [1, 2]]),      # a tensor larger than the buffer travels alone
    ([5, 5], 100, [[0, 1]]),
    ([], 10, []),
    ([0, 0], 10, [[0, 1]]),
])
def test_chunks_are_cut_as_vllms_pack_tensors_cuts_them(sizes: list[int], buffer: int, chunks: list[list[int]]) -> None:
    assert [list(r) for r in chunk_plan(sizes, buffer)] == chunks


# ------------------------------------------------------------------------ a push's tensors against the model

SCHEMA = {"a.weight": v.TensorSpec((4, 2), "F32"), "b.weight": v.TensorSpec((3,), "BF16")}


def test_a_push_that_fits_the_model_passes_with_its_size() -> None:
    assert v.validate_tensor_metadata(["b.weight", "a.weight"], ["bfloat16", "float32"], [[3], [4, 2]], SCHEMA) == 38


@pytest.mark.parametrize("names,dtypes,shapes,field,code,tensor", [
    (["a.weight", "b.weight", "c"], ["float32", "bfloat16", "float32"], [[4, 2], [3], [1]], "update_info.names[2]",
     v.CODE_UNKNOWN_TENSOR, "c"),
    (["a.weight", "b.weight", "a.weight"], ["float32", "bfloat16", "float32"], [[4, 2], [3], [4, 2]],
     "update_info.names[2]", v.CODE_DUPLICATE_TENSOR, "a.weight"),
    (["a.weight", "b.weight"], ["float32", "bfloat16"], [[2, 4], [3]], "update_info.shapes[0]",
     v.CODE_SHAPE_MISMATCH, "a.weight"),
    (["a.weight", "b.weight"], ["float32", "float16"], [[4, 2], [3]], "update_info.dtype_names[1]",
     v.CODE_DTYPE_MISMATCH, "b.weight"),
    (["a.weight", "b.weight"], ["float32", "complex64"], [[4, 2], [3]], "update_info.dtype_names[1]",
     v.CODE_DTYPE_MISMATCH, "b.weight"),
    (["a.weight"], ["float32"], [[4, 2]], "update_info.names", v.CODE_MISSING_TENSOR, "b.weight"),
])
def test_a_push_that_does_not_fit_is_refused_naming_the_tensor_and_the_field(
        names: list[str], dtypes: list[str], shapes: list[list[int]], field: str, code: str, tensor: str) -> None:
    with pytest.raises(v.CheckpointInvalid) as e:
        v.validate_tensor_metadata(names, dtypes, shapes, SCHEMA)
    assert (e.value.field, e.value.code, e.value.tensor) == (field, code, tensor)
    assert e.value.status_code == 400 and tensor in e.value.message


# ------------------------------------------------------------------------ the order of the calls

ORDER = ["init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update"]


def test_each_call_is_allowed_exactly_where_the_state_machine_says_and_otherwise_names_itself() -> None:
    for call, phases in ALLOWED.items():
        for phase in EXPECTS:
            error = out_of_order(call, phase)  # type: ignore[arg-type]
            if phase in phases:
                assert error is None, (call, phase)
            else:
                assert error is not None and error.status_code == 409 and error.field == call, (call, phase)
                assert error.message.startswith(f"{call} is out of order: ") and EXPECTS[phase] in error.message
    # The round, in order, from idle: each call allowed in the phase the previous one leads to.
    s = TransferSession()
    for call, then in zip(ORDER, ["joined", "started", "received", "joined"], strict=True):
        s.require(call)  # type: ignore[arg-type]
        s.enter(then)  # type: ignore[arg-type]
    # Nothing moving: a trainer may always join again (a restarted one) or leave.
    for quiet in ("idle", "joined", "started", "received"):
        assert out_of_order("init_weight_transfer_engine", quiet) is None  # type: ignore[arg-type]
    for busy in ("joining", "receiving", "writing"):
        assert out_of_order("init_weight_transfer_engine", busy) is not None  # type: ignore[arg-type]
        assert out_of_order("shutdown_weight_transfer_engine", busy) is not None  # type: ignore[arg-type]


# ------------------------------------------------------------------------ the routes, on the fake engine

INIT = {"init_info": {"master_address": "127.0.0.1", "master_port": 29400, "world_size": 2}}


@dataclass
class Replica:
    core: SamplerCore
    engine: FakeEngine
    receiver: FakeWeightReceiver
    c: httpx.AsyncClient
    update: dict[str, Any]  # an update_info that fits the tiny model

    async def health(self) -> dict[str, Any]:
        h: dict[str, Any] = (await self.c.get("/health")).json()
        return h

    async def push(self, label: str | None = None, **options: Any) -> httpx.Response:
        for path, body in (("/init_weight_transfer_engine", INIT), ("/start_weight_update", None),
                           ("/update_weights", {"update_info": {**self.update, **options}})):
            r = await self.c.post(path, json=body)
            if r.status_code != 200:
                return r
        return await self.c.post("/finish_weight_update", json={"weight_version": label} if label else None)


def tiny_update(model: Path) -> dict[str, Any]:
    torch_name = {st: t for t, st in v.TORCH_DTYPES.items()}
    schema = v.schema_from_checkpoint_dir(model)
    return {"names": list(schema), "dtype_names": [torch_name[s.dtype] for s in schema.values()],
            "shapes": [list(s.shape) for s in schema.values()]}


@pytest.fixture
async def replica(tiny_model: Path, tmp_path: Path) -> AsyncIterator[Replica]:
    core, engine = fake_core(weight_transfer_backend="gloo", weights_state_path=tmp_path / "weights.json")
    core.set_model_dir(str(tiny_model))
    engine.receiver = FakeWeightReceiver(engine)
    async with fake_client(core) as c:
        yield Replica(core, engine, engine.receiver, c, tiny_update(tiny_model))


@pytest.mark.parametrize("in_flight", ["drain", "abort", "keep"])
async def test_a_push_is_written_in_each_mode_under_its_label_and_recorded(replica: Replica, tmp_path: Path,
                                                                           in_flight: str) -> None:
    before = await replica.health()
    r = await replica.push("net-1", step=7, in_flight=in_flight)
    assert r.status_code == 200, r.text
    out = r.json()
    h = await replica.health()
    assert out["weights_label"] == h["weights_label"] == "net-1" and out["weights_step"] == h["weights_step"] == 7
    assert h["weights_version"] == before["weights_version"] + 1 and h["status"] == "ok"
    assert h["weights_sha256"] == out["weights_sha256"] and is_hex_digest(out["weights_sha256"])
    assert h["intended"] == {"checkpoint": None, "version_label": "net-1", "sha256_manifest": None, "step": 7,
                             "sha256": out["weights_sha256"]}
    assert h["weight_transfer"] == {**h["weight_transfer"], "backend": "gloo", "phase": "joined"}
    assert json.loads((tmp_path / "weights.json").read_text())["sha256"] == out["weights_sha256"]
    # No weight_version: a label made of the digest.
    r = await replica.push(step=8)
    assert r.status_code == 200 and r.json()["weights_label"] == f"sha256-{r.json()['weights_sha256'][:16]}", r.text


async def test_a_keep_push_continues_a_sample_in_flight(replica: Replica) -> None:
    replica.engine.token_delay_s = 0.0
    await replica.engine.pause()  # the sample is surely in flight at the write
    task = asyncio.ensure_future(replica.c.post("/v1/sample", json={**GOOD, "sampling_params": {"max_tokens": 4}}))
    await until(lambda: replica.engine.held_requests() == 1)
    r = await replica.push("net-k", in_flight="keep")
    assert r.status_code == 200, r.text
    answer = await task
    assert answer.status_code == 200 and answer.json()["results"][0]["sequences"][0]["weights_spans"][-1]["label"] \
        == "net-k", answer.text
    assert outcomes(replica.core) == {"ok": 1.0}


async def test_a_torn_push_writes_nothing_and_the_replica_leaves_the_group(replica: Replica) -> None:
    before = await replica.health()
    replica.receiver.tear_receive = True
    for path, body in (("/init_weight_transfer_engine", INIT), ("/start_weight_update", None)):
        assert (await replica.c.post(path, json=body)).status_code == 200
    r = await replica.c.post("/update_weights", json={"update_info": replica.update})
    assert r.status_code == 502 and r.json()["error"]["category"] == "transfer_failed", r.text
    assert r.json()["error"]["field"] == "update_info" and "nothing was written" in r.json()["error"]["message"]
    h = await replica.health()
    assert h["weight_transfer"] is None and h["status"] == "ok" and h["weights_version"] == before["weights_version"]
    assert replica.receiver.joined is None  # it left the group
    assert metric((await replica.c.get("/metrics")).text, "sampler_weight_transfers_total", outcome="torn") == 1
    # Out of order now (no trainer joined); from init, the next push works.
    assert (await replica.c.post("/start_weight_update")).status_code == 409
    assert (await replica.push("net-2")).status_code == 200


async def test_once_a_trainer_joins_the_workers_prepare_a_block_of_the_models_push_size(replica: Replica,
                                                                                          tiny_model: Path) -> None:
    """Where the pushes land, touched before the first one (sampler_common/weight_transfer/landing.py): asked
    at every join, of the size of any push of the model; the real engine's block: tests/engine."""
    size = block_bytes(v.schema_sizes(v.schema_from_checkpoint_dir(tiny_model)))
    assert (await replica.c.post("/init_weight_transfer_engine", json=INIT)).status_code == 200
    assert replica.receiver.prepared == [size]
    assert (await replica.push("net-1")).status_code == 200  # joins again
    assert replica.receiver.prepared == [size, size]


async def test_with_drop_pushed_weights_no_block_is_prepared(tiny_model: Path) -> None:
    core, engine = fake_core(weight_transfer_backend="gloo", drop_pushed_weights=True)
    core.set_model_dir(str(tiny_model))
    engine.receiver = receiver = FakeWeightReceiver(engine)
    async with fake_client(core) as c:
        r = Replica(core, engine, receiver, c, tiny_update(tiny_model))
        assert (await r.push("net-1")).status_code == 200
    assert receiver.joined is not None and receiver.prepared == []


async def test_a_tear_at_the_join_is_a_502_naming_the_address(replica: Replica) -> None:
    replica.receiver.tear_join = True
    r = await replica.c.post("/init_weight_transfer_engine", json=INIT)
    assert r.status_code == 502 and r.json()["error"]["field"] == "init_info.master_address", r.text
    assert (await replica.health())["weight_transfer"] is None
    assert replica.receiver.prepared == []  # no trainer joined: no block made for it


async def test_bytes_that_differ_from_the_senders_are_refused_naming_the_tensor(replica: Replica) -> None:
    replica.receiver.mismatch_tensor = "lm_head.weight"
    r = await replica.push("bad")
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "sha256_mismatch" and err["tensor"] == "lm_head.weight", r.text
    assert (await replica.health())["weights_label"] == "base"


async def test_a_tensor_that_does_not_fit_is_refused_before_anything_is_received(replica: Replica) -> None:
    shapes = [list(s) for s in replica.update["shapes"]]
    shapes[0] = [1] + shapes[0]
    r = await replica.push("bad", shapes=shapes)
    err = r.json()["error"]
    assert r.status_code == 400 and err["field"] == "update_info.shapes[0]" and err["code"] == "shape_mismatch"
    assert err["tensor"] == replica.update["names"][0]
    assert not replica.receiver.receiving.is_set() and replica.receiver.joined is None
    r = await replica.push("bad", kv="recompute")  # kv without keep: refused too, naming it
    assert r.status_code == 400 and r.json()["error"]["field"] == "update_info.kv", r.text


async def test_health_shows_a_push_being_received_and_a_second_call_meanwhile_is_a_409(replica: Replica) -> None:
    replica.receiver.receive_gate = asyncio.Event()
    for path, body in (("/init_weight_transfer_engine", INIT), ("/start_weight_update", None)):
        assert (await replica.c.post(path, json=body)).status_code == 200
    update = asyncio.ensure_future(replica.c.post("/update_weights", json={"update_info": replica.update}))
    await until(replica.receiver.receiving.is_set)
    t = (await replica.health())["weight_transfer"]
    assert t["phase"] == "receiving" and 0 < t["bytes_received"] < t["total_bytes"], t
    for path, body in (("/init_weight_transfer_engine", INIT), ("/update_weights", {"update_info": replica.update}),
                       ("/shutdown_weight_transfer_engine", None)):
        r = await replica.c.post(path, json=body)
        assert r.status_code == 409 and r.json()["error"]["field"] == path.lstrip("/"), r.text
    assert (await replica.c.post("/v1/sample", json=GOOD)).status_code == 200  # sampling goes on meanwhile
    replica.receiver.receive_gate.set()
    assert (await update).status_code == 200
    assert (await replica.health())["weight_transfer"]["phase"] == "received"


@pytest.mark.parametrize("case,path,body,status,field", BAD_TRANSFER_REQUESTS,
                         ids=[c[0] for c in BAD_TRANSFER_REQUESTS])
async def test_bad_control_calls_name_the_field_and_change_nothing(replica: Replica, case: str, path: str, body: Any,
                                                                  status: int, field: str) -> None:
    r = await replica.c.post(path, json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["field"] == field, r.text
    h = await replica.health()
    assert h["status"] == "ok" and h["weights_version"] == 0 and h["weight_transfer"] is None, h
    assert (await replica.push("after")).status_code == 200  # nothing lost: the next push works


async def test_a_replica_without_a_backend_says_so_naming_backend() -> None:
    core, _ = fake_core()
    async with fake_client(core) as c:
        for path, body in (("/init_weight_transfer_engine", INIT), ("/start_weight_update", None)):
            r = await c.post(path, json=body)
            assert r.status_code == 400 and r.json()["error"]["field"] == "backend", r.text
        assert (await c.get("/get_world_size")).status_code == 400


TRANSFER_PATHS = {"/init_weight_transfer_engine", "/start_weight_update", "/update_weights", "/finish_weight_update",
                  "/shutdown_weight_transfer_engine", "/get_world_size"}


def test_fuzzed_control_calls_get_no_5xx(tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The fuzz suite (tests/support/fuzz.py) on the protocol's routes, with the backend ON: the fake engine's
    receiver joins and receives without a network, so a generated `master_address` is never connected to
    (the engine tier fuzzes the same routes on vLLM, backend off: tests/engine/test_fuzz_real.py)."""
    from sampler_pod.http.openapi import SPEC_PATH
    from tests.support.fuzz import fuzz

    spec = json.loads(SPEC_PATH.read_text())
    spec["paths"] = {p: ops for p, ops in spec["paths"].items() if p in TRANSFER_PATHS}
    assert set(spec["paths"]) == TRANSFER_PATHS
    with run_server(tiny_model, "--weight-transfer-backend", "gloo", "--weights-state-path",
                    str(tmp_path / "weights.json"), engine="fake") as s, s.client() as c:
        figures = fuzz(s.url, 60, spec=spec)
        health = c.get("/health").json()
        sample = c.post("/v1/sample", json=GOOD)
    with capsys.disabled():
        print("\n" + figures.summary())
    assert figures.requests >= 300, figures.summary()
    assert not figures.server_errors, "\n".join(figures.server_errors[:20])
    assert not figures.dropped, "\n".join(figures.dropped[:20])
    assert health["status"] == "ok" and sample.status_code == 200, (health, sample.text)


def test_a_receive_is_looked_at_often_near_its_end_and_rarely_in_its_middle() -> None:
    from sampler_pod.engine.vllm import MAX_RECEIVE_POLL_S, STAGE_POLL_S, receive_poll_s

    assert receive_poll_s(0, 100, 5.0) == STAGE_POLL_S  # nothing yet: no rate to go by
    assert receive_poll_s(100, 100, 5.0) == STAGE_POLL_S  # every byte in: the verdict is near
    assert receive_poll_s(10, 100, 1.0) == MAX_RECEIVE_POLL_S  # 9 s to go at this rate
    assert receive_poll_s(90, 100, 0.9) == pytest.approx(0.05)  # 0.1 s to go: look again half-way
    assert receive_poll_s(99, 100, 0.099) == STAGE_POLL_S
