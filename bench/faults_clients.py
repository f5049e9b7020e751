"""The clients of the Faults soak (bench/faults.py): closed-loop threads in their own process (in the
orchestrator's process they would starve its fault and rollout steps of the GIL, and the other way
round), each sending its next request through the gateway as soon as the last one ended, as a
trainer's sampler loop does.

A "request" here is one logical sample as a client sees it, from its first send to its terminal
answer, whatever it took on the way, because that is what a fault can lose:
- `sample`: native sync `POST /v1/sample`; `opt_out`: the same with `X-Sampler-No-Retry: 1` (a lost
  replica is then a 502 `replica_lost`, by contract);
- `twinkle`: Twinkle's sync sample (`/api/v1/sampler/<model>/twinkle/sample`);
- `future`: native submit + retrieve (long-poll); `tinker`: Tinker's `asample` + `retrieve_future`.
  A 410 on a future is the contract for "its replica was lost: resubmit", and the client resubmits,
  as the Tinker SDK does: counted as resubmitted, not failed.
Every kind honours a 503/429 with `Retry-After` (no replica may take it now: a rollout step, a
restart) by waiting as told and sending again, as the SDKs do; each such wait is counted. Each
record keeps its send and terminal moments (`time.monotonic`, one clock for every process on the
machine) so the orchestrator can put it in the fault window it overlapped.
"""

from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import asdict, dataclass
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import httpx

# Shares of the mix (weights of random.choices).
KINDS = {"sample": 45, "opt_out": 10, "twinkle": 15, "future": 15, "tinker": 15}
TOKENS = (20, 120)            # per request, at the fake engine's 1 ms a token
DEADLINE_S = 120.0            # past this without a terminal answer, a request is lost (hung)
CALL_TIMEOUT_S = 60.0         # one HTTP exchange (a retrieve long-polls 5 s)
MAX_RETRY_AFTER_S = 1.0
RETRYABLE = (429, 503)


@dataclass
class Record:
    kind: str
    sent: float
    ended: float
    status: int                     # the terminal answer's HTTP status; 0: none (connection error, deadline)
    category: str | None = None     # the error body's category, when not 200
    label: str | None = None        # weights_label of a 200 sync sample
    replica: str | None = None      # X-Sampler-Replica of the terminal answer
    retried: str | None = None      # X-Sampler-Retried: the gateway re-ran it after that replica was lost
    resubmitted: int = 0            # futures answered 410 and submitted again
    waited: int = 0                 # 503/429 + Retry-After answers waited out and sent again
    error: str | None = None


def _category(r: httpx.Response) -> str | None:
    try:
        body = r.json()
    except ValueError:
        return None
    if not isinstance(body, dict):
        return None
    err = body.get("error")
    if isinstance(err, dict):
        return str(err.get("category"))
    return str(body.get("category")) if "category" in body else None


class Client:
    def __init__(self, http: httpx.Client, rng: random.Random, model: str, stop: Event) -> None:
        self.http, self.rng, self.model, self.stop = http, rng, model, stop

    def _tokens(self) -> list[int]:
        return [self.rng.randrange(1, 100) for _ in range(self.rng.randint(2, 6))]

    def _params(self) -> dict[str, Any]:
        return {"max_tokens": self.rng.randint(*TOKENS), "temperature": 1.0}

    def post(self, path: str, body: dict[str, Any], rec: Record, headers: dict[str, str] | None = None,
             patient: bool = True) -> httpx.Response:
        """POST; a 503/429 with Retry-After is waited out and sent again until the record's deadline."""
        while True:
            r = self.http.post(path, json=body, headers=headers)
            ra = r.headers.get("retry-after")
            if not (patient and r.status_code in RETRYABLE and ra is not None):
                return r
            if time.monotonic() - rec.sent > DEADLINE_S:
                return r
            rec.waited += 1
            # As told (capped): the client's own pacing, as an SDK's retry loop paces itself.
            time.sleep(min(float(ra), MAX_RETRY_AFTER_S))

    def _end(self, rec: Record, r: httpx.Response) -> Record:
        rec.ended, rec.status = time.monotonic(), r.status_code
        rec.replica, rec.retried = r.headers.get("x-sampler-replica"), r.headers.get("x-sampler-retried") \
            or rec.retried
        if r.status_code == 200:
            body = r.json()
            rec.label = body.get("weights_label") if isinstance(body, dict) else None
            if isinstance(body, dict) and "error" in body:     # Tinker's failed future: 200 {error, category}
                rec.status, rec.category = 500, str(body.get("category"))
                rec.error = str(body.get("error"))[:300]
        else:
            rec.category, rec.error = _category(r), r.text[:300]
        return rec

    def one(self, kind: str) -> Record:
        rec = Record(kind, time.monotonic(), 0.0, 0)
        try:
            return self._one(kind, rec)
        except httpx.HTTPError as e:
            rec.ended, rec.status, rec.error = time.monotonic(), 0, f"{type(e).__name__}: {e}"[:300]
            return rec

    def _one(self, kind: str, rec: Record) -> Record:
        native = {"prompts": [self._tokens()], "sampling_params": self._params()}
        if kind in ("sample", "opt_out"):
            headers = {"X-Sampler-No-Retry": "1"} if kind == "opt_out" else None
            return self._end(rec, self.post("/v1/sample", native, rec, headers))
        if kind == "twinkle":
            body: dict[str, Any] = {"inputs": [{"input_ids": self._tokens()}], "sampling_params": self._params()}
            return self._end(rec, self.post(f"/api/v1/sampler/{self.model}/twinkle/sample", body, rec))
        if kind == "future":
            return self._future(rec, "/v1/sample/submit", native, "/v1/sample/retrieve",
                                lambda rid: {"request_id": rid, "wait_s": 5},
                                lambda r: r.status_code == 202)
        if kind == "tinker":
            body = {"base_model": self.model, "num_samples": 1,
                    "prompt": {"chunks": [{"type": "encoded_text", "tokens": self._tokens()}]},
                    "sampling_params": self._params()}
            return self._future(rec, "/api/v1/asample", body, "/api/v1/retrieve_future",
                                lambda rid: {"request_id": rid},
                                lambda r: r.status_code == 200 and r.json().get("type") == "try_again")
        raise AssertionError(kind)

    def _future(self, rec: Record, submit: str, body: dict[str, Any], retrieve: str, ask: Any, running: Any) -> Record:
        while True:
            r = self.post(submit, body, rec)
            if r.status_code != 200:
                return self._end(rec, r)
            rid = r.json()["request_id"]
            while True:
                g = self.post(retrieve, ask(rid), rec)
                if not running(g):
                    break
                if time.monotonic() - rec.sent > DEADLINE_S:
                    rec.ended, rec.error = time.monotonic(), f"still running after {DEADLINE_S:g} s"
                    return rec
            if g.status_code == 410 and time.monotonic() - rec.sent <= DEADLINE_S:
                rec.resubmitted += 1        # its replica was lost: the contract says resubmit
                continue
            return self._end(rec, g)


def run(url: str, model: str, concurrency: int, seed: int, out: str, stop: Event, done: Any) -> None:
    """The client process: `concurrency` closed loops until `stop`; every record written to `out`
    (JSON lines) at the end; `done` (a shared counter) counts terminal answers as they come."""
    records: list[Record] = []
    lock = threading.Lock()

    def loop(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        with httpx.Client(base_url=url, timeout=CALL_TIMEOUT_S) as http:
            client = Client(http, rng, model, stop)
            while not stop.is_set():
                rec = client.one(rng.choices(list(KINDS), weights=list(KINDS.values()))[0])
                with lock:
                    records.append(rec)
                with done.get_lock():
                    done.value += 1
                if rec.status == 0:
                    stop.wait(0.2)      # nothing answered: no hot loop of refused connections

    threads = [threading.Thread(target=loop, args=(i,), name=f"faults-client-{i}") for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    Path(out).write_text("".join(json.dumps(asdict(r)) + "\n" for r in records))


def read(out: Path) -> list[Record]:
    return [Record(**json.loads(line)) for line in out.read_text().splitlines() if line]
