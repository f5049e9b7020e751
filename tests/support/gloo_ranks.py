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

Both kinds of process send only to 127.0.0.1. Each is forked by a `Zygote`, one process that imported torch,
vLLM and the gloo engines once: a fresh interpreter per rank spent ~9 s of CPU each on those imports, most of
the chain's tests' time, for no part of what they check.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import queue
import select
import signal
import socket
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


class Forked:
    """A rank forked by the zygote, with the part of `subprocess.Popen` that `Rank` uses. It is the zygote's
    child, not this process's: its end is read from a pidfd."""

    def __init__(self, pid: int, stdin: Any, stdout: Any) -> None:
        self.pid, self.stdin, self.stdout = pid, stdin, stdout
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:  # gone already
            self._pidfd = None

    def poll(self) -> int | None:
        """0 once it ended (its status belongs to the zygote), else None."""
        return None if self._pidfd is not None and not select.select([self._pidfd], [], [], 0)[0] else 0

    def wait(self, timeout: float) -> int:
        if self._pidfd is not None and not select.select([self._pidfd], [], [], timeout)[0]:
            raise subprocess.TimeoutExpired(f"rank {self.pid}", timeout)
        return 0

    def close(self) -> None:
        for f in (self.stdin, self.stdout):
            with contextlib.suppress(OSError):
                f.close()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None


class Zygote:
    """One process that imported what a rank needs, forking a rank per `spawn`: the rank's stdin and stdout
    are pipes made here, handed over a unix socket with the command, so a rank reads and writes them as it
    would a subprocess's (its stdout closes when it dies)."""

    def __init__(self) -> None:
        self.log_path = Path(tempfile.mkdtemp(prefix="gloo-zygote-")) / "zygote.log"
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "tests.support.gloo_ranks", "zygote",
                                          str(theirs.fileno())], cwd=REPO_ROOT, pass_fds=(theirs.fileno(),),
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        theirs.close()
        self._sock.settimeout(START_TIMEOUT_S)
        try:
            assert self._sock.recv(64) == b"ready", self.log_path.read_text()[-4000:]
        except TimeoutError:
            raise AssertionError(f"the zygote did not start within {START_TIMEOUT_S:g}s:\n"
                                 f"{self.log_path.read_text()[-4000:]}") from None

    def fork(self, args: tuple[str, ...], log_path: Path) -> Forked:
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            socket.send_fds(self._sock, [json.dumps(args).encode()], [in_r, out_w, log_fd])
            pid = int(self._sock.recv(64))
        finally:
            for fd in (in_r, out_w, log_fd):  # the rank holds its own copies now
                os.close(fd)
        return Forked(pid, os.fdopen(in_w, "w"), os.fdopen(out_r, "r"))

    def close(self) -> None:
        self._sock.close()  # its loop ends at the socket's end
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)


@dataclass
class Rank:
    """A rank's process. A command carries an id that its answer echoes (a receiver answers a `wait` on a
    thread of its own, so a test may ask its status meanwhile); lines without one (ready, stalled, the
    trainer's control calls and outcomes) go to `lines`. Its stderr goes to a log file."""

    proc: Forked
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

    def close(self) -> None:
        """Killed if alive; its pipes and pidfd closed."""
        if self.alive:
            self.kill()
        self.proc.close()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None and not self.gone.is_set()


@contextlib.contextmanager
def spawn(zygote: Zygote, *args: str, ready: bool = True) -> Iterator[Rank]:
    """A rank forked by `zygote`; killed at the end if it is still alive. `ready`: wait for its ready line."""
    log_path = Path(tempfile.mkdtemp(prefix="gloo-rank-")) / "rank.log"
    rank = Rank(zygote.fork(args, log_path), log_path)
    try:
        if ready:
            assert rank.next(START_TIMEOUT_S) == {"ready": True}
        yield rank
    finally:
        rank.close()


@contextlib.contextmanager
def receivers(zygote: Zygote, n: int) -> Iterator[list[Rank]]:
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(spawn(zygote, "receiver")) for _ in range(n)]


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
def trainer(zygote: Zygote, seed: int, **wire: Any) -> Iterator[Rank]:
    """The trainer's process. It joins its receivers as it starts (`trainer_init`): a `Gateway` answers that
    init before the trainer says it is ready (`Gateway.next`)."""
    with spawn(zygote, "trainer", str(seed), json.dumps(wire), ready=False) as rank:
        yield rank


def _run_rank(args: list[str]) -> None:
    if args[0] == "receiver":
        _receiver_main()
    else:
        _trainer_main(int(args[1]), json.loads(args[2]))


def _zygote_main(sock_fd: int) -> None:
    """Import once, then fork a rank per command: `[args]` with the rank's stdin, stdout and log as fds."""
    import torch  # noqa: F401  (what every rank imports: the point of the zygote)
    from vllm.distributed.weight_transfer.base import WeightSource  # noqa: F401

    from sampler_client.weight_transfer import StateDictSource  # noqa: F401
    from sampler_common.weight_transfer import gloo  # noqa: F401

    sock = socket.socket(fileno=sock_fd)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the ranks: the test reads their end
    sock.send(b"ready")
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(sock, 65536, 3)
        except OSError:
            return
        if not msg:  # the test closed its end
            return
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                sock.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for fd, to in zip(fds, (0, 1, 2), strict=True):
                    os.dup2(fd, to)
                    os.close(fd)
                # New file objects: the zygote's were its own pipes, with buffers of their own.
                sys.stdin = open(0, closefd=False)  # noqa: SIM115
                sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
                sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
                _run_rank(json.loads(msg))
                code = 0
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                with contextlib.suppress(Exception):
                    sys.stdout.flush()
                    sys.stderr.flush()
                os._exit(code)
        for fd in fds:
            os.close(fd)
        sock.send(str(pid).encode())


if __name__ == "__main__":
    if sys.argv[1] == "zygote":
        _zygote_main(int(sys.argv[2]))
    else:
        _run_rank(sys.argv[1:])
