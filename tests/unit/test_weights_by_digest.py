"""Issue #51 (phases D and E) on the replica, fake engine: a load that names its weights by model digest
(`sha256`) writes the push the replica holds, its kept copy, a peer's copy or a checkpoint, in that order,
or is a 409 naming `sha256` with nothing written; the kept copy streams to a peer as a safetensors file;
a peer's stream is checked (the digest asked for, the model's schema, every byte) before anything is
written. The pure parts first (the stream reader), then the routes in process, then real processes on
127.0.0.1 for the catch-up itself (the peer is reached over HTTP). The real engine's catch-up:
tests/engine/test_weights_pool_network_real.py.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from safetensors import safe_open

from sampler_common.weight_transfer.digest import TensorRecord, model_sha256
from sampler_pod.core.sampler import SamplerCore
from sampler_pod.engine.base import KeptWeights, TensorMeta
from sampler_pod.engine.fake import FakeEngine, FakeWeightReceiver, salt_of
from sampler_pod.weights import validation as v
from sampler_pod.weights.peer_copy import CopyReader, PeerCopyFailed, batched, header_bytes
from tests.support.bad_requests import GOOD
from tests.support.inproc import fake_client, fake_core
from tests.support.network_push import checkpoint_sha256
from tests.support.server import RunningServer, run_server, wait_until

from .test_weight_transfer import INIT, tiny_update

# ------------------------------------------------------------------------ the stream, pure

SCHEMA = {"a.weight": v.TensorSpec((2, 2), "F32"), "b.bias": v.TensorSpec((3,), "BF16"),
          "c.scalar": v.TensorSpec((), "F32")}
TENSORS = {"a.weight": bytes(range(16)), "b.bias": b"\x01\x02\x03\x04\x05\x06", "c.scalar": b"\x00\x00\x80\x3f"}
DTYPES = {"a.weight": "float32", "b.bias": "bfloat16", "c.scalar": "float32"}


def _kept() -> KeptWeights:
    metas = tuple(TensorMeta(n, DTYPES[n], SCHEMA[n].shape, len(TENSORS[n])) for n in ("b.bias", "a.weight",
                                                                                      "c.scalar"))
    digest = model_sha256(TensorRecord(m.name, m.dtype, m.shape, hashlib.sha256(TENSORS[m.name]).hexdigest())
                          for m in metas)
    return KeptWeights(digest, metas)


def _stream(kept: KeptWeights, label: str | None = "net-1", step: int | None = 3) -> bytes:
    return header_bytes(kept, label, step) + b"".join(TENSORS[t.name] for t in kept.tensors)


def test_the_kept_copy_streams_as_a_safetensors_file_any_tool_reads(tmp_path: Path) -> None:
    kept = _kept()
    path = tmp_path / "model.safetensors"
    path.write_bytes(_stream(kept))
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "pt", "sha256": kept.sha256, "label": "net-1", "step": "3"}
        assert sorted(f.keys()) == sorted(TENSORS)
        for name in TENSORS:
            t = f.get_tensor(name)
            assert tuple(t.shape) == SCHEMA[name].shape
            assert t.contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes() == TENSORS[name]
    assert (8 + struct.unpack("<Q", path.read_bytes()[:8])[0]) % 8 == 0  # the data starts 8-byte aligned


@pytest.mark.parametrize("piece", [1, 7, 64, 1 << 20])
def test_a_peers_stream_read_in_pieces_of_any_size_is_written_where_its_header_says(piece: int) -> None:
    kept = _kept()
    raw = _stream(kept)
    reader = CopyReader(kept.sha256.upper(), SCHEMA)
    data = bytearray(sum(t.nbytes for t in kept.tensors))
    for i in range(0, len(raw), piece):
        for offset, chunk in reader.feed(raw[i:i + piece]):
            data[offset:offset + len(chunk)] = chunk
    reader.finish()
    assert [t.name for t in reader.tensors or []] == ["b.bias", "a.weight", "c.scalar"]
    assert bytes(data) == b"".join(TENSORS[t.name] for t in kept.tensors)
    assert reader.label == "net-1" and reader.received == reader.total_bytes == len(data)


def _refused(raw: bytes, sha256: str, schema: dict[str, v.TensorSpec] = SCHEMA) -> str:
    reader = CopyReader(sha256, schema)
    with pytest.raises(PeerCopyFailed) as e:
        reader.feed(raw)
        reader.finish()
    return str(e.value)


def test_a_peers_stream_that_is_not_what_was_asked_for_is_refused_naming_why() -> None:
    kept = _kept()
    good = _stream(kept)
    assert "offers sha256" in _refused(good, "ab" * 32)
    assert "ended after" in _refused(good[:-3], kept.sha256)
    assert "ended before its header" in _refused(good[:5], kept.sha256)
    assert "more than the" in _refused(good + b"\x00", kept.sha256)
    flipped = bytearray(good)
    flipped[-1] ^= 1  # one bit of the last tensor
    assert f"is {kept.sha256}" not in (why := _refused(bytes(flipped), kept.sha256)) and "model digest" in why
    # A copy of another model: its tensors are checked as a checkpoint's are, before a byte is written.
    other = {**SCHEMA, "a.weight": v.TensorSpec((4,), "F32")}
    assert "does not fit the served model" in (why := _refused(good, kept.sha256, other)) and "a.weight" in why
    assert "not a safetensors header" in _refused(struct.pack("<Q", 4) + b"nope", kept.sha256)
    assert "exceeds" in _refused(struct.pack("<Q", 1 << 40), kept.sha256)


def test_pieces_are_gathered_into_slices_before_they_go_to_the_engine() -> None:
    ready, pending = batched([(0, b"ab"), (2, b"cd"), (4, b"e")], None, size=4)
    assert ready == [(0, b"abcd")] and pending == (4, bytearray(b"e"))
    ready, pending = batched([(5, b"fgh")], pending, size=4)
    assert ready == [(4, b"efgh")] and pending is None


# ------------------------------------------------------------------------ in process: the held push, the kept copy


@dataclass
class Replica:
    core: SamplerCore
    engine: FakeEngine
    c: httpx.AsyncClient
    update: dict[str, Any]

    async def receive(self) -> str:
        """init, start, update: a push held, received and verified, not written. Its digest."""
        for path, body in (("/init_weight_transfer_engine", INIT), ("/start_weight_update", None),
                           ("/update_weights", {"update_info": self.update})):
            r = await self.c.post(path, json=body)
            assert r.status_code == 200, r.text
        return str(r.json()["sha256"])

    async def health(self) -> dict[str, Any]:
        h: dict[str, Any] = (await self.c.get("/health")).json()
        return h


@pytest.fixture
async def replica(tiny_model: Path, tmp_path: Path) -> AsyncIterator[Replica]:
    core, engine = fake_core(weight_transfer_backend="gloo", weights_state_path=tmp_path / "weights.json",
                             checkpoint_roots=[tiny_model.parent])
    core.set_model_dir(str(tiny_model))
    engine.receiver = FakeWeightReceiver(engine)
    async with fake_client(core) as c:
        yield Replica(core, engine, c, tiny_update(tiny_model))


async def test_a_load_by_digest_writes_the_push_held_in_its_own_mode_and_keeps_a_copy(replica: Replica) -> None:
    digest = await replica.receive()
    assert (await replica.health())["weights_label"] == "base"  # received: nothing written yet
    r = await replica.c.post("/v1/checkpoints/load", json={"version_label": "net-1", "sha256": digest.upper(),
                                                           "step": 4, "in_flight": "keep"})
    assert r.status_code == 200, r.text
    out, h = r.json(), await replica.health()
    assert out["source"] == "push" and out["weights_sha256"] == digest and out["weights_label"] == "net-1"
    assert (h["weights_label"], h["weights_step"], h["weights_sha256"], h["weights_version"]) == ("net-1", 4, digest, 1)
    assert h["weights_source"] == "push"
    assert h["intended"] == {"checkpoint": None, "version_label": "net-1", "sha256_manifest": None, "step": 4,
                             "sha256": digest}
    assert h["weight_transfer"]["phase"] == "joined"  # the round is over; the trainer's group stays
    assert replica.engine.weights_salt == salt_of(digest)
    kept = await replica.engine.kept()
    assert kept is not None and kept.sha256 == digest and len(kept.tensors) == len(replica.update["names"])
    # Again, under another label: nothing held any more, so from the kept copy.
    r = await replica.c.post("/v1/checkpoints/load", json={"version_label": "net-1b", "sha256": digest})
    assert r.status_code == 200 and r.json()["source"] == "kept", r.text
    assert ((await replica.health())["weights_label"], (await replica.health())["weights_source"]) == ("net-1b", "kept")


async def test_the_kept_copy_is_served_to_a_peer_and_is_what_was_pushed(replica: Replica, tmp_path: Path) -> None:
    digest = await replica.receive()
    assert (await replica.c.post("/finish_weight_update", json={"weight_version": "net-2"})).status_code == 200
    r = await replica.c.get("/v1/weights/staged", params={"sha256": digest})
    assert r.status_code == 200 and r.headers["content-type"] == "application/octet-stream", r.text
    assert int(r.headers["content-length"]) == len(r.content) and r.headers["x-sampler-weights-sha256"] == digest
    path = tmp_path / "copy.safetensors"
    path.write_bytes(r.content)
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata()["label"] == "net-2" and f.metadata()["sha256"] == digest
        recs = []
        for name in f.keys():
            t = f.get_tensor(name).contiguous()
            raw = t.view(-1).view(__import__("torch").uint8).numpy().tobytes()
            recs.append(TensorRecord(name, str(t.dtype).removeprefix("torch."), tuple(t.shape),
                                     hashlib.sha256(raw).hexdigest()))
    assert model_sha256(recs) == digest  # the digest recomputed here, from the file a peer receives
    missing = await replica.c.get("/v1/weights/staged", params={"sha256": "ab" * 32})
    assert missing.status_code == 404 and missing.json()["error"]["field"] == "sha256"
    assert digest in missing.json()["error"]["message"]  # it says which copy it keeps
    bad = await replica.c.get("/v1/weights/staged", params={"sha256": "xyz"})
    assert bad.status_code == 400 and bad.json()["error"]["field"] == "query.sha256", bad.text


async def test_dropping_pushed_weights_keeps_no_copy(tiny_model: Path) -> None:
    core, engine = fake_core(weight_transfer_backend="gloo", drop_pushed_weights=True)
    core.set_model_dir(str(tiny_model))
    engine.receiver = FakeWeightReceiver(engine)
    async with fake_client(core) as c:
        r = Replica(core, engine, c, tiny_update(tiny_model))
        digest = await r.receive()
        assert (await c.post("/finish_weight_update", json={"weight_version": "n"})).status_code == 200
        assert await engine.kept() is None
        assert (await c.get("/v1/weights/staged", params={"sha256": digest})).status_code == 404


async def test_a_load_by_digest_found_nowhere_is_a_409_naming_sha256_and_writes_nothing(replica: Replica) -> None:
    digest = await replica.receive()
    other = "cd" * 32
    r = await replica.c.post("/v1/checkpoints/load", json={"version_label": "x", "sha256": other})
    err = r.json()["error"]
    assert r.status_code == 409 and err["category"] == "weights_unavailable" and err["field"] == "sha256", r.text
    assert other in err["message"] and "no peers named" in err["message"] and "nothing was written" in \
        err["message"].lower()
    h = await replica.health()
    assert (h["weights_label"], h["weights_version"], h["status"]) == ("base", 0, "ok")
    assert h["weight_transfer"]["phase"] == "received"  # the push it holds is still there, for its own load
    r = await replica.c.post("/v1/checkpoints/load", json={"version_label": "y", "sha256": digest})
    assert r.status_code == 200 and r.json()["source"] == "push"


@pytest.mark.parametrize("body,field", [
    ({"version_label": "x"}, "path"),
    ({"version_label": "x", "path": "/a", "peers": ["http://127.0.0.1:1"]}, "peers"),
    ({"version_label": "x", "sha256": "zz" * 32}, "sha256"),
    ({"version_label": "x", "sha256": "ab" * 31}, "sha256"),
    ({"version_label": "x", "sha256": "ab" * 32, "peers": ["ftp://127.0.0.1:1"]}, "peers[0]"),
    ({"version_label": "x", "sha256": "ab" * 32, "peers": ["http://127.0.0.1:1/v1/path"]}, "peers[0]"),
    ({"version_label": "x", "sha256": "ab" * 32, "peers": ["http://a..b:1"]}, "peers[0]"),  # IDNA refuses it
    ({"version_label": "x", "sha256": "ab" * 32, "peers": ["http://" + "a" * 64 + ":1"]}, "peers[0]"),
    ({"version_label": "x", "sha256": "ab" * 32, "peers": ["http://127.0.0.1:1", "http://h:70000"]}, "peers[1]"),
    ({"version_label": "x", "sha256": "ab" * 32, "test_fail_after_tensors": 1}, "test_fail_after_tensors"),
    ({"version_label": "x", "sha256": "ab" * 32, "kv": "recompute"}, "kv"),
])
async def test_bad_loads_by_digest_name_the_field_and_change_nothing(replica: Replica, body: dict[str, Any],
                                                                     field: str) -> None:
    r = await replica.c.post("/v1/checkpoints/load", json=body)
    assert r.status_code == 400 and r.json()["error"]["field"] == field, r.text
    h = await replica.health()
    assert (h["weights_version"], h["status"]) == (0, "ok")


async def test_a_checkpoint_named_with_its_digest_is_checked_against_it_before_a_write(replica: Replica,
                                                                                      tiny_model: Path) -> None:
    digest = checkpoint_sha256(tiny_model)  # computed here, from the files, outside the code under test
    wrong = "0" * 64
    for mode in ("drain", "keep"):
        r = await replica.c.post("/v1/checkpoints/load", json={"path": str(tiny_model), "version_label": "bad",
                                                               "sha256": wrong, "in_flight": mode})
        err = r.json()["error"]
        assert r.status_code == 400 and err["field"] == "sha256" and err["code"] == "sha256_mismatch", r.text
        assert digest in err["message"]
    assert (await replica.health())["weights_version"] == 0
    # By digest with no copy anywhere but the checkpoint: loaded from disk, the digest checked.
    r = await replica.c.post("/v1/checkpoints/load", json={"path": str(tiny_model), "version_label": "durable",
                                                           "sha256": digest, "step": 9})
    assert r.status_code == 200 and r.json()["source"] == "checkpoint", r.text
    h = await replica.health()
    assert (h["weights_label"], h["weights_sha256"], h["weights_checkpoint"]) == ("durable", digest, str(tiny_model))
    assert h["intended"]["sha256"] == digest and h["intended"]["checkpoint"] == str(tiny_model)


# ------------------------------------------------------------------------ real processes: the catch-up over HTTP

ADMIN = "tml-admin-peer"


def _pushed(server: RunningServer, model: Path, label: str) -> str:
    """A push into `server` (fake receiver), finished: the replica writes and keeps it. Its digest."""
    with server.client(headers={"X-API-Key": ADMIN}) as c:
        for path, body in (("/init_weight_transfer_engine", INIT), ("/start_weight_update", None),
                           ("/update_weights", {"update_info": tiny_update(model)}),
                           ("/finish_weight_update", {"weight_version": label})):
            r = c.post(path, json=body)
            assert r.status_code == 200, r.text
        return str(r.json()["weights_sha256"])


def _started(c: httpx.Client) -> bool:
    """The start-up is over (/startedz): serving, or waiting for weights it can load."""
    try:
        return c.get("/startedz").status_code == 200
    except httpx.HTTPError:
        return False


def _greedy(c: httpx.Client) -> list[int]:
    r = c.post("/v1/sample", json={"prompts": [[1, 2, 3]], "sampling_params": {"max_tokens": 8, "temperature": 0}})
    assert r.status_code == 200, r.text
    tokens: list[int] = r.json()["results"][0]["sequences"][0]["tokens"]
    return tokens


def test_a_replica_started_after_a_push_waits_unready_and_catches_up_from_a_peer(tiny_model: Path,
                                                                                tmp_path: Path) -> None:
    """A replica that must serve pushed weights (a restart's state file, or a replacement's --initial-sha256)
    waits `starting`, never serving the base model; a load naming a peer catches it up, the copy verified,
    and it serves exactly what the peer serves. A peer without the weights, or none, is a 409 naming
    `sha256` with the reasons, and it goes on waiting."""
    args = ["--weight-transfer-backend", "gloo", "--admin-api-key", ADMIN, "--checkpoint-root", str(tiny_model.parent)]
    with run_server(tiny_model, *args, engine="fake") as peer, run_server(tiny_model, *args, engine="fake") as empty:
        digest = _pushed(peer, tiny_model, "net-1")
        with peer.client() as c:
            want = _greedy(c)
        start = ["--initial-version-label", "net-1", "--initial-sha256", digest, "--initial-step", "3"]
        with run_server(tiny_model, *args, *start, engine="fake", wait=False) as late, \
                late.client(headers={"X-API-Key": ADMIN}) as c:
            wait_until(lambda: _started(c), "the late replica to finish starting")
            h = c.get("/health").json()
            assert h["status"] == "starting" and c.get("/readyz").status_code == 503, h
            assert h["reason"].startswith(f"intended checkpoint unavailable: network push net-1 (sha256 {digest})"), h
            assert c.post("/v1/sample", json=GOOD).status_code == 503  # never the base model under net-1
            load = {"version_label": "net-1", "sha256": digest, "step": 3}
            r = c.post("/v1/checkpoints/load", json={**load, "peers": [empty.url, "http://127.0.0.1:1"]})
            err = r.json()["error"]
            assert r.status_code == 409 and err["field"] == "sha256", r.text
            assert f"peer {empty.url}: it answered 404" in err["message"] and "http://127.0.0.1:1:" in err["message"]
            assert c.get("/health").json()["status"] == "starting"
            r = c.post("/v1/checkpoints/load", json={**load, "peers": [empty.url, peer.url]})
            assert r.status_code == 200 and r.json()["source"] == f"peer {peer.url}", r.text
            h = c.get("/health").json()
            assert (h["status"], h["weights_label"], h["weights_step"], h["weights_sha256"], h["weights_source"]) == \
                ("ok", "net-1", 3, digest, f"peer {peer.url}"), h
            assert _greedy(c) == want
            # It keeps the copy it caught up: the next replica may catch up from it.
            assert c.get("/v1/weights/staged", params={"sha256": digest}).status_code == 200
            with empty.client(headers={"X-API-Key": ADMIN}) as e:
                r = e.post("/v1/checkpoints/load", json={**load, "peers": [late.url]})
                assert r.status_code == 200 and r.json()["source"] == f"peer {late.url}", r.text
                assert _greedy(e) == want
        # The key is the pool's admin key: a peer asked with another one refuses (the copy is the weights).
        with httpx.Client(base_url=peer.url) as anonymous:
            assert anonymous.get("/v1/weights/staged", params={"sha256": digest}).status_code == 401


def test_a_restart_after_a_push_waits_unready_rather_than_serve_other_weights(tiny_model: Path, tmp_path: Path) -> None:
    """The state file records the push (label, step, digest); a restarted container has no copy of it, so it
    waits, `starting` with the reason, and a checkpoint load (or a peer's copy) makes it ready again."""
    state = tmp_path / "weights.json"
    args = ["--weight-transfer-backend", "gloo", "--weights-state-path", str(state),
            "--checkpoint-root", str(tiny_model.parent)]
    with run_server(tiny_model, *args, engine="fake") as s, s.client() as c:
        for path, body in (("/init_weight_transfer_engine", INIT), ("/start_weight_update", None),
                           ("/update_weights", {"update_info": tiny_update(tiny_model)}),
                           ("/finish_weight_update", {"weight_version": "net-1"})):
            r = c.post(path, json=body)
            assert r.status_code == 200, r.text
        digest = r.json()["weights_sha256"]
    with run_server(tiny_model, *args, engine="fake", wait=False) as s, s.client() as c:
        wait_until(lambda: _started(c), "the restarted replica to finish starting")
        h = c.get("/health").json()
        assert h["status"] == "starting" and c.get("/readyz").status_code == 503, h
        assert h["reason"] == f"intended checkpoint unavailable: network push net-1 (sha256 {digest}) (weights " \
                              "pushed over the network have no durable copy here; waiting for a load that names a " \
                              "peer holding them (the operator sends one) or a checkpoint)", h
        assert json.loads(state.read_text())["sha256"] == digest
        assert c.post("/v1/sample", json=GOOD).status_code == 503
        r = c.post("/v1/checkpoints/load", json={"path": str(tiny_model), "version_label": "base-again"})
        assert r.status_code == 200, r.text
        assert c.get("/health").json()["status"] == "ok"
