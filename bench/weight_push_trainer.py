"""The trainer of bench/weight_push.py: a process of its own (as a trainer is), holding the models' weights in
memory, that pushes them into a pool over the network or through a checkpoint on disk, and measures the
loopback floor of the network's transport. One JSON command per line on stdin, one JSON answer per line on
stdout (vLLM logs to stdout too: answers are the lines that start with `{`):

    {"op": "weights", "name", "model": DIR}          -> {"bytes", "tensors"}: the model's tensors, held under `name`
    {"op": "net", "url", "name", "seed", "label", "in_flight"}
        -> a push with sampler_client's `NetworkPusher` (what `Pool.push_weights` holds): the group is kept
           from push to push to the same `url`, as a trainer keeps it
    {"op": "disk", "urls", "name", "seed", "label", "in_flight", "dir", "fsync", "evict"}
        -> today's disk push: write the weights as one safetensors file (fsync'd, as a durable checkpoint is;
           `evict`: then dropped from the page cache), then a load on every replica at once, as a static pool's
           Keep rollout does
    {"op": "write", "name", "seed", "dir", "evict"}  -> the file alone (the catch-up's disk arm)
    {"op": "floor", "bytes", "chunk", "repeats"}     -> the loopback floor: gloo point-to-point to a receiver
                                                        process, chunks of `chunk` bytes, no packing, no hashing
    {"op": "close"}                                  -> leave every group (before the replicas stop)

The weights pushed are the model's tensors nudged by noise of `seed` (the served model's names, dtypes and
shapes; a new digest per seed), made before the clock starts. Every push answers `t0` (time.monotonic() at
the call: the bench reads the same clock), `t1` (its return), the trainer's CPU-seconds over the call (all
its threads, from getrusage), and what the replicas answered.

Run: `python -m bench.weight_push_trainer` (the bench starts it); `... receive PORT BYTES CHUNK REPEATS` is the
floor's receiver.
"""

from __future__ import annotations

import datetime
import json
import os
import resource
import subprocess
import sys
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import requests
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed import TCPStore

from sampler_client.weight_transfer import NetworkPusher, StateDictSource, WeightSyncClient
from sampler_common.weight_transfer import relay
from sampler_common.weight_transfer.gloo import open_group

HOST = "127.0.0.1"
TIMEOUT_S = 600.0
NUDGE = 0.01  # how far each weight set moves from the model: new digests, the same shapes


def answer(doc: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()


def cpu_s() -> float:
    """CPU-seconds of this process, every thread of it."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class RecordingClient(WeightSyncClient):
    """sampler_client's control client, keeping the finish's answer: the replicas' write (their `paused_s`),
    which vLLM's client API drops."""

    finish: dict[str, Any] = {}

    def post(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        out = super().post(path, body)
        if path == "finish_weight_update":
            self.finish = out
        return out


def replica_answers(finish: dict[str, Any]) -> list[dict[str, Any]]:
    """Each replica's write answer: a gateway's finish lists them under `replicas`, a replica's is its own."""
    replicas = finish.get("replicas")
    return list(replicas.values()) if isinstance(replicas, dict) else [finish]


class Trainer:
    def __init__(self) -> None:
        self.models: dict[str, dict[str, torch.Tensor]] = {}
        # Weight sets made so far, by (model, seed): the two the pushes alternate between stay, and one more
        # (a catch-up's, new each time).
        self.sets: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
        self.pushers: dict[str, NetworkPusher] = {}
        self.http = requests.Session()

    def load(self, name: str, model: str) -> dict[str, Any]:
        base: dict[str, torch.Tensor] = {}
        for path in sorted(Path(model).glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as f:
                for tensor in f.keys():
                    base[tensor] = f.get_tensor(tensor)
        self.models[name] = base
        return {"bytes": sum(t.numel() * t.element_size() for t in base.values()), "tensors": len(base)}

    def weights(self, name: str, seed: int) -> dict[str, torch.Tensor]:
        """The model `name`'s tensors nudged by seeded noise: the served model's names, shapes and dtypes, a
        digest of their own."""
        key = (name, seed)
        if key not in self.sets:
            for old in [k for k in self.sets if k[1] > 2]:
                del self.sets[old]
            g = torch.Generator().manual_seed(seed)
            self.sets[key] = {n: (t + torch.randn(t.shape, generator=g, dtype=t.dtype) * NUDGE).contiguous()
                              for n, t in self.models[name].items()}
        return self.sets[key]

    def net(self, cmd: dict[str, Any]) -> dict[str, Any]:
        pusher = self.pushers.get(cmd["url"])
        if pusher is None:
            pusher = NetworkPusher(cmd["url"], None, master_address=HOST)
            pusher.client = RecordingClient(cmd["url"], None)
            self.pushers[cmd["url"]] = pusher
        source = StateDictSource(self.weights(cmd["name"], cmd["seed"]))
        c0, t0 = cpu_s(), time.monotonic()
        result = pusher.push(source, cmd["label"], in_flight=cmd["in_flight"])
        t1, c1 = time.monotonic(), cpu_s()
        assert isinstance(pusher.client, RecordingClient)
        return {"t0": t0, "t1": t1, "cpu_s": c1 - c0, "bytes": result.bytes, "sha256": result.sha256,
                "send_s": result.send_s, "replicas": replica_answers(pusher.client.finish)}

    def write(self, weights: dict[str, torch.Tensor], directory: str, fsync: bool, evict: bool) -> dict[str, float]:
        """The weights as one safetensors file in `directory` (made afresh), as a trainer saves a checkpoint.
        `evict` (after the fsync): the file's pages out of this host's page cache, so the replicas read it from
        the device, as replicas on other nodes read a shared volume (rather than this host's memory)."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        path = out / "model.safetensors"
        t0 = time.monotonic()
        save_file(weights, str(path))
        t1 = time.monotonic()
        if fsync:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                if evict:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean after the fsync: dropped
            finally:
                os.close(fd)
            fd = os.open(out, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        return {"write_s": t1 - t0, "fsync_s": time.monotonic() - t1}

    def disk(self, cmd: dict[str, Any]) -> dict[str, Any]:
        weights = self.weights(cmd["name"], cmd["seed"])
        c0, t0 = cpu_s(), time.monotonic()
        written = self.write(weights, cmd["dir"], cmd["fsync"], cmd["evict"])
        body = {"path": cmd["dir"], "version_label": cmd["label"], "in_flight": cmd["in_flight"]}

        def load(url: str) -> dict[str, Any]:
            r = self.http.post(url + "/v1/checkpoints/load", json=body, timeout=TIMEOUT_S)
            assert r.status_code == 200, r.text
            out: dict[str, Any] = r.json()
            return out

        with ThreadPoolExecutor(len(cmd["urls"])) as pool:
            replicas = list(pool.map(load, cmd["urls"]))
        t1, c1 = time.monotonic(), cpu_s()
        return {"t0": t0, "t1": t1, "cpu_s": c1 - c0, "replicas": replicas, **written}

    def floor(self, size: int, chunk: int, repeats: int) -> dict[str, Any]:
        """Seconds per transfer of `size` bytes to a receiver process over gloo, chunk by chunk, two chunks in
        flight (the chain's window); one transfer not counted first. The receiver acknowledges each transfer
        once every chunk landed: the time is to that."""
        store = TCPStore(HOST, 0, 2, True, timeout=datetime.timedelta(seconds=TIMEOUT_S), wait_for_workers=False)
        receiver = subprocess.Popen([sys.executable, "-m", "bench.weight_push_trainer", "receive", str(store.port),
                                     str(size), str(chunk), str(repeats + 1)])
        try:
            group = open_group(store, 0, 2, HOST, TIMEOUT_S)
            hop = relay.Hop(group, 0, 2)
            buf = torch.ones(chunk, dtype=torch.uint8)
            ack = torch.zeros(1, dtype=torch.uint8)
            sizes = chunk_sizes(size, chunk)
            times = []
            for rep in range(repeats + 1):
                t0 = time.monotonic()
                pending: deque[Any] = deque()
                for i, n in enumerate(sizes):
                    if len(pending) == relay.WINDOW:
                        pending.popleft().result()
                    pending.append(relay.send(hop, buf[:n], i))
                while pending:
                    pending.popleft().result()
                group.recv([ack], 1, len(sizes)).wait()
                if rep:
                    times.append(time.monotonic() - t0)
            relay.close_connections(hop)
        finally:
            receiver.wait(60)
        return {"seconds": times}

    def close(self) -> None:
        for pusher in self.pushers.values():
            pusher.close()
        self.pushers = {}


def chunk_sizes(size: int, chunk: int) -> list[int]:
    return [min(chunk, size - i) for i in range(0, size, chunk)]


def receive(port: int, size: int, chunk: int, transfers: int) -> None:
    store = TCPStore(HOST, port, 2, False, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    group = open_group(store, 1, 2, HOST, TIMEOUT_S)
    sizes = chunk_sizes(size, chunk)
    # Buffers kept from transfer to transfer and touched first: the floor of the wire, not of page faults.
    bufs = [torch.zeros(chunk, dtype=torch.uint8) for _ in range(relay.WINDOW)]
    for _ in range(transfers):
        posted: deque[Any] = deque()
        for i, n in enumerate(sizes):
            if len(posted) == relay.WINDOW:
                posted.popleft().wait()
            posted.append(group.recv([bufs[i % relay.WINDOW][:n]], 0, i))
        while posted:
            posted.popleft().wait()
        group.send([torch.ones(1, dtype=torch.uint8)], 0, len(sizes)).wait()
    # Wait for the trainer to close its connections: leaving first would fail its last wait.
    try:
        group.recv([torch.zeros(1, dtype=torch.uint8)], 0, (1 << 31) - 2).wait()
    except RuntimeError:
        pass


def main() -> None:
    if sys.argv[1:2] == ["receive"]:
        port, size, chunk, transfers = (int(x) for x in sys.argv[2:6])
        receive(port, size, chunk, transfers)
        return
    trainer = Trainer()
    answer({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            op = cmd["op"]
            if op == "weights":
                out = trainer.load(cmd["name"], cmd["model"])
            elif op == "net":
                out = trainer.net(cmd)
            elif op == "disk":
                out = trainer.disk(cmd)
            elif op == "write":
                out = trainer.write(trainer.weights(cmd["name"], cmd["seed"]), cmd["dir"], True, cmd["evict"])
            elif op == "floor":
                out = trainer.floor(cmd["bytes"], cmd["chunk"], cmd["repeats"])
            elif op == "close":
                trainer.close()
                out = {}
            else:
                raise ValueError(f"unknown op {op!r}")
            answer({"ok": True, **out})
        except Exception as e:  # the bench prints it and stops
            answer({"ok": False, "error": f"{type(e).__name__}: {e}"})


if __name__ == "__main__":
    main()
