"""Samples provably in flight at a weights write, on a real engine with the test seams: N futures are
submitted to a frozen engine (so they start in one step), then run until the engine reports a token for
each and frozen again by the server itself (`POST /v1/test/engine/run-until-started`), and each one's
token count read, so a keep-mode write's boundary is known per sample. A freeze decided by polling over
HTTP raced the samples: on a loaded box the first of 16 samples submitted one by one could end (L tokens)
before the last one's first token was seen. Used by the keep-mode tests of checkpoint loads and of pushes
over the network. Nothing here sleeps."""

from __future__ import annotations

import httpx

L = 480           # tokens per sample: the prompt (8) + L fit --max-model-len 512
N = 16            # samples in flight


def prompt(i: int) -> list[int]:
    return [1, 17 + i, 42, 99, 123 + i, 7, 250, 31]


def submit_all(c: httpx.Client) -> list[str]:
    """N samples queued in a frozen engine: `freeze_mid_generation` starts them together."""
    assert c.post("/v1/test/engine/pause").status_code == 200
    rids = []
    for i in range(N):
        r = c.post("/v1/sample/submit", json={"prompts": [prompt(i)], "sampling_params": {
            "max_tokens": L, "temperature": 0.0, "ignore_eos": True}})
        assert r.status_code == 200, r.text
        rids.append(r.json()["request_id"])
    return rids


def freeze_mid_generation(c: httpx.Client, rids: list[str]) -> dict[str, int]:
    """Run the engine until every sample has produced a token, freeze it, and return each one's count."""
    r = c.post("/v1/test/engine/run-until-started", json={"ids": [f"{rid}-0" for rid in rids]})
    assert r.status_code == 200, r.text
    got = r.json()["tokens"]
    counts = {rid: got[f"{rid}-0"] for rid in rids}
    assert all(1 <= n < L for n in counts.values()), counts   # mid-generation, each of them
    return counts


def retrieve(c: httpx.Client, rid: str) -> httpx.Response:
    while True:
        r = c.post("/v1/sample/retrieve", json={"request_id": rid, "wait_s": 25})
        if r.status_code != 202:
            return r


def assert_continued(answers: dict[str, httpx.Response], counts: dict[str, int], old: tuple[str, int],
                     new: tuple[str, int]) -> None:
    """Each answer is its whole sample (L tokens), its tokens before the freeze from the `old` (label,
    version) weights and every later one from the `new`: the spans split exactly at its count."""
    for rid, a in answers.items():
        assert a.status_code == 200, a.text
        seq = a.json()["results"][0]["sequences"][0]
        b = counts[rid]
        assert len(seq["tokens"]) == L and seq["stop_reason"] == "length"
        assert seq["weights_spans"] == [
            {"label": old[0], "version": old[1], "start": 0, "end": b},
            {"label": new[0], "version": new[1], "start": b, "end": L}], (rid, b)
        assert a.json()["weights_label"] == new[0]     # the weights of its last token
