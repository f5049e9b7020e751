"""The ranks of a gloo push in processes of their own, with no engine, and the test as their control plane:
what tests/engine/test_gloo_chain.py kills.

* A **receiver** (`python -m tests.support.gloo_ranks receiver`) hosts the replica's worker side,
  `GlooWeightTransferEngine`, and takes one JSON command per stdin line, answering each on stdout:
  `init` (answers once joined or failed), `start`, `update` (starts the receive, answers at once),
  `wait` (until the engine is in one of `phases`), `status`, `take` (the received tensors' bytes, hex),
  `finish`, `discard`.
* The **trainer** (`python -m tests.support.gloo_ranks trainer SEED WIRE`) holds `tensors(SEED)` and pushes
  them with `GlooTrainerWeightTransferEngine` on `{"op": "push", "stall_after"?: N}`; vLLM's control calls
  its engine makes go out on stdout as `{"call", "body"}` and wait for the test's `{"reply": {"error"?}}`.
  `stall_after: N` stops after N tensors were handed to the sender, answers `{"stalled": true}`, and goes on
  at `{"op": "resume"}`. It answers a push with `{"ok": true, "result"}` or `{"ok": false, "error"}`.
* `Gateway` plays the pool's gateway for the trainer's control calls, as phase B fans them out: the init
  to every receiver at once with its own `rank_offset`, the update to every receiver, answered once each
  has received (or with the first failure).

Both kinds of process send only to 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support import REPO_ROOT

START_TIMEOUT_S = 120.0
ANSWER_TIMEOUT_S = 120.0

# Mixed dtypes and odd sizes: a bf16 tensor of odd length puts the fp32 one after it at an offset torch
# cannot view in place; an empty tensor; one larger than a small chunk.
MIXED = [("a.bf16_odd", "bfloat16", (3,)), ("b.f32", "float32", (5, 2)), ("c.i8", "int8", (7,)),
         ("d.f64", "float64", (3,)), ("e.empty", "float32", (0,)), ("f.f16", "float16", (2, 3)),
         ("g.big", "float32", (64, 33)), ("h.scalar", "float32", ()), ("i.last_empty", "int8", (0,))]


def tensors(seed: int) -> dict[str, Any]:
    """The trainer's tensors for `seed`: the same in the trainer's process and in the test's."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return {name: (torch.randn(shape, generator=g) * 50).to(getattr(torch, dtype)) for name, dtype, shape in MIXED}


def raw(t: Any) -> str:
    """A tensor's bytes, C-contiguous, as hex."""
    import torch

    return bytes(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hex()


# ---------------------------------------------------------------------------- the test's side


@dataclass
class Rank:
    """A rank's process. A command carries an id that its answer echoes (a receiver answers a `wait` on a
    thread of its own, so a test may ask its status meanwhile); lines without one (ready, stalled, the
    trainer's control calls and outcomes) go to `lines`. Its stderr goes to a log file."""

    proc: subprocess.Popen[str]
    log_path: Path
    lines: queue.Queue[dict[str, Any]] = field(default_factory=queue.Queue)
    _answers: dict[int, queue.Queue[dict[str, Any]]] = field(default_factory=dict)
    _ids: itertools.count[int] = field(default_factory=itertools.count)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    gone: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                msg = json.loads(line)
                if "id" in msg:
                    self._answers[msg.pop("id")].put(msg)
                else:
                    self.lines.put(msg)
        # Its stdout closed: the process is gone, and so is every answer still owed.
        self.gone.set()
        for q in list(self._answers.values()):
            q.put({"error": "it is gone"})

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        with self._lock:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()

    def next(self, timeout: float = ANSWER_TIMEOUT_S) -> dict[str, Any]:
        return self._get(self.lines, timeout)

    def _get(self, q: queue.Queue[dict[str, Any]], timeout: float) -> dict[str, Any]:
        try:
            return q.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"rank process {self.proc.pid} did not answer within {timeout:g}s:\n"
                                 f"{self.log_path.read_text()[-4000:]}") from None

    def call(self, **cmd: Any) -> dict[str, Any]:
        """A receiver's command, and its answer (an error at once if the process is gone)."""
        key = next(self._ids)
        self._answers[key] = queue.Queue()
        try:
            if self.gone.is_set():
                return {"error": "it is gone"}
            try:
                self.send(**cmd, id=key)
            except OSError:
                return {"error": "it is gone"}
            return self._get(self._answers[key], ANSWER_TIMEOUT_S)
        finally:
            del self._answers[key]

    def kill(self) -> None:
        """SIGKILL: its sockets closed by the kernel, mid-whatever."""
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None and not self.gone.is_set()


@contextlib.contextmanager
def spawn(*args: str) -> Iterator[Rank]:
    log_path = Path(tempfile.mkdtemp(prefix="gloo-rank-")) / "rank.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tests.support.gloo_ranks", *args], cwd=REPO_ROOT,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
    rank = Rank(proc, log_path)
    try:
        assert rank.next(START_TIMEOUT_S) == {"ready": True}
        yield rank
    finally:
        if rank.alive:
            rank.kill()


@contextlib.contextmanager
def receivers(n: int) -> Iterator[list[Rank]]:
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(spawn("receiver")) for _ in range(n)]


class Gateway:
    """Answers the trainer's control calls by driving the receivers, as a pool's gateway does: receiver k
    takes `rank_offset` 1 + k (one worker each). A dead receiver's call fails; the update's answer is the
    first failure (a refusal or a tear), else ok."""

    def __init__(self, trainer: Rank, ranks: list[Rank]) -> None:
        self.trainer, self.ranks = trainer, ranks
        self.calls: list[str] = []
        self.outcomes: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        # Each call on a thread of its own: an update is answered only once the push is received, and the
        # test meanwhile reads the trainer's other lines (a stall) and acts.
        while True:
            msg = self.trainer.lines.get()
            if "call" in msg:
                threading.Thread(target=self.answer, args=(msg,), daemon=True).start()
            else:
                self.outcomes.put(msg)

    def _run(self, k: int, *cmds: dict[str, Any]) -> dict[str, Any]:
        """`cmds` in turn to receiver `k`: its last answer, or its first error."""
        out: dict[str, Any] = {}
        for cmd in cmds:
            out = self.ranks[k].call(**cmd)
            if out.get("error"):
                break
        return out

    def answer(self, call: dict[str, Any]) -> None:
        """One control call of the trainer, sent to every receiver at once and answered at the first failure
        (naming the receiver; one that is gone first: the others' failures follow from it), or once all
        succeeded."""
        name, body = call["call"], call.get("body")
        self.calls.append(name)
        if name == "init_weight_transfer_engine":
            cmds: list[list[dict[str, Any]]] = [[{"op": "init", "init_info": {**(body or {}), "rank_offset": 1 + k}}]
                                                for k in range(len(self.ranks))]
            want = "joined"
        elif name == "update_weights":
            cmds = [[{"op": "update", "update_info": body}, {"op": "wait", "phases": ["received", "failed"]}]
                    for _ in self.ranks]
            want = "received"
        else:
            cmds = [[{"op": {"start_weight_update": "start", "finish_weight_update": "finish"}[name]}]
                    for _ in self.ranks]
            want = ""
        pool = ThreadPoolExecutor(len(self.ranks))
        futures = {pool.submit(self._run, k, *cmds[k]): k for k in range(len(self.ranks))}
        error = None
        for f in as_completed(futures):
            out = f.result()
            if out.get("error") or (want and out.get("phase") != want):
                gone = [k for k, r in enumerate(self.ranks) if not r.alive]
                k = gone[0] if gone else futures[f]
                error = f"receiver {k}: it is gone" if gone else f"receiver {k}: {out.get('error') or out}"
                break
        pool.shutdown(wait=False)
        with contextlib.suppress(OSError):  # a trainer killed meanwhile
            self.trainer.send(reply={"error": error} if error else {})

    def next(self, timeout: float = ANSWER_TIMEOUT_S) -> dict[str, Any]:
        """The trainer's next line that is not a control call: ready, stalled, or a push's outcome."""
        try:
            return self.outcomes.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"the trainer did not answer within {timeout:g}s:\n"
                                 f"{self.trainer.log_path.read_text()[-4000:]}") from None

    def push(self, **cmd: Any) -> dict[str, Any]:
        """A push of the trainer's tensors; its outcome."""
        self.trainer.send(op="push", **cmd)
        return self.next()


def wait_phase(rank: Rank, phases: set[str], timeout: float) -> dict[str, Any]:
    """The receiver's status once its engine is in one of `phases` (its own state), failing past `timeout`."""
    return rank.call(op="wait", phases=sorted(phases), timeout=timeout)


# ---------------------------------------------------------------------------- inside the processes


_stdout = threading.Lock()


def _answer(doc: dict[str, Any]) -> None:
    with _stdout:
        sys.stdout.write(json.dumps(doc) + "\n")
        sys.stdout.flush()


def _receiver_main() -> None:
    import torch

    from sampler_common.weight_transfer import gloo

    config = types.SimpleNamespace(parallel_config=types.SimpleNamespace(data_parallel_index=0, world_size=1, rank=0),
                                   model_config=None)
    engine = gloo.GlooWeightTransferEngine(None, config, torch.device("cpu"), torch.nn.Linear(1, 1))

    def wait(phases: list[str], timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while (status := engine.status())["phase"] not in phases:
            if time.monotonic() > deadline:
                return {**status, "error": f"still {status['phase']} after {timeout:g}s"}
            time.sleep(0.005)
        return status

    def run(cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd["op"]
        if op == "init":
            engine.init_transfer_engine(engine.parse_init_info(
                {k: v for k, v in cmd["init_info"].items() if k != "backend"}))
            return wait(["joined", "failed"], 120)
        if op == "start":
            engine.start_weight_update()
            return {"ok": True}
        if op == "update":
            engine.update_weights({k: v for k, v in cmd["update_info"].items() if k not in ("step", "in_flight", "kv")})
            return {"ok": True}
        if op == "status":
            return engine.status()
        if op == "finish":
            engine.finish_weight_update()
            return {"ok": True}
        if op == "take":
            got = engine.take_received()
            return {"tensors": [[n, str(t.dtype).removeprefix("torch."), list(t.shape), raw(t)] for n, t in got]}
        if op == "discard":
            engine.discard()
            return engine.status()
        return {"error": f"unknown op {op!r}"}

    def answer(cmd: dict[str, Any]) -> None:
        try:
            out = wait(cmd["phases"], cmd.get("timeout", 90)) if cmd["op"] == "wait" else run(cmd)
        except Exception as e:
            out = {"error": f"{type(e).__name__}: {e}"}
        _answer({**out, "id": cmd["id"]})

    _answer({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "wait":  # only reads the engine's status: on a thread, so the next command is served
            threading.Thread(target=answer, args=(cmd,), daemon=True).start()
        else:
            answer(cmd)


class _ControlRelay:
    """vLLM's control client, relayed to the test: each call out on stdout, its reply in from stdin."""

    def __init__(self, replies: queue.Queue[dict[str, Any]]) -> None:
        self.replies = replies
        self.lock = threading.Lock()  # the engine makes one call at a time, but from several threads

    def _call(self, name: str, body: Any = None) -> None:
        with self.lock:
            _answer({"call": name, "body": body})
            reply = self.replies.get()
        if reply.get("error"):
            raise RuntimeError(f"{name}: {reply['error']}")

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._call("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self._call("start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._call("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("finish_weight_update", weight_version)


def _trainer_main(seed: int, wire: dict[str, Any]) -> None:
    from vllm.distributed.weight_transfer.base import WeightSource

    from sampler_client.weight_transfer import StateDictSource
    from sampler_common.weight_transfer import gloo

    source = StateDictSource(tensors(seed))
    replies: queue.Queue[dict[str, Any]] = queue.Queue()
    commands: queue.Queue[dict[str, Any]] = queue.Queue()
    resume = threading.Event()

    def read() -> None:
        for line in sys.stdin:
            msg = json.loads(line)
            if "reply" in msg:
                replies.put(msg["reply"])
            elif msg.get("op") == "resume":
                resume.set()
            else:
                commands.put(msg)

    threading.Thread(target=read, daemon=True).start()

    class Stalling(WeightSource):  # type: ignore[misc]
        def __init__(self, n: int) -> None:
            self.n = n

        def metadata(self) -> Any:
            return source.metadata()

        def __iter__(self) -> Any:
            for i, pair in enumerate(source):
                if i == self.n:
                    _answer({"stalled": True})
                    resume.wait()
                yield pair

    gloo.register_trainer_engine()
    info = gloo.GlooTrainerInitInfo(master_address="127.0.0.1", rank=0, **wire)
    engine = gloo.GlooTrainerWeightTransferEngine.trainer_init(info, client=_ControlRelay(replies), source=source)
    _answer({"ready": True})
    while True:
        cmd = commands.get()
        resume.clear()
        engine.source = Stalling(cmd["stall_after"]) if cmd.get("stall_after") is not None else source
        try:
            result = engine.send_weights(weight_version=cmd.get("label"))
            assert result is not None
            _answer({"ok": True, "result": {"sha256": result.sha256, "tensors": result.tensors, "bytes": result.bytes}})
        except Exception as e:
            _answer({"ok": False, "error": f"{type(e).__name__}: {e}"})


@contextlib.contextmanager
def trainer(seed: int, **wire: Any) -> Iterator[Rank]:
    """The trainer's process. It joins its receivers as it starts (`trainer_init`): a `Gateway` answers that
    init before the trainer says it is ready (`Gateway.next`)."""
    log_path = Path(tempfile.mkdtemp(prefix="gloo-rank-")) / "rank.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tests.support.gloo_ranks", "trainer", str(seed),
                                 json.dumps(wire)], cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=log, text=True)
    rank = Rank(proc, log_path)
    try:
        yield rank
    finally:
        if rank.alive:
            rank.kill()


if __name__ == "__main__":
    if sys.argv[1] == "receiver":
        _receiver_main()
    else:
        _trainer_main(int(sys.argv[2]), json.loads(sys.argv[3]))
