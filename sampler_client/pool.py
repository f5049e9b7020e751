"""`Pool`: one SamplerPool seen through its gateway's admin routes (docs/guide/pool.md, "Pushing weights"
and "Pushing an adapter").

The rollout's decisions are the operator's; this side only writes the pool's target and reads back
how far it got. A push returns the pool object's generation; waiting means reading the rollout until
the operator has observed that generation and its `Progressing` condition says complete (every
replica serves the label) or stopped (a replica refused the checkpoint: `RolloutStopped`, with the
replica's own validation error, which names the file and tensor). A later push of other weights
supersedes this one (`RolloutSuperseded`): the pool rolls towards the newest.

Waiting reads `GET /v1/pool/rollout` as a long poll: each read names the pool's `resource_version`
last seen, and the gateway answers once the pool moved past it (the operator wrote a step of the
rollout), so the trainer learns that its rollout completed when the operator writes it, not up to a
poll interval later. A gateway without the long poll (its answers carry no `resource_version`) is
read every `poll_interval_s`. A gateway that restarts meanwhile is read again until the deadline, as
a trainer would want, since the rollout goes on without it.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from .errors import PoolError, RequestRefused

DEFAULT_TIMEOUT_S = 600.0
# An adapter push answers once the version is loaded: a replica validates and loads the files first.
ADAPTER_PUSH_TIMEOUT_S = 330.0
POLL_INTERVAL_S = 0.5
# How long one long-poll read may wait at the gateway for the pool to change (its limit is 20 s);
# at most half the request's own timeout.
LONG_POLL_S = 10.0

# Where progress goes: a callable given each line, True (a tqdm bar on a terminal when tqdm is
# installed, else lines on stderr) or False (nothing).
Progress = bool | Callable[[str], None]


@dataclass(frozen=True)
class ReplicaRollout:
    name: str
    phase: str | None
    weights_label: str | None
    state: str | None  # Updated, Updating, Outdated, Draining, Leaving, Rejected
    draining: bool

    def line(self) -> str:
        return f"{self.name}: {self.state} (phase {self.phase}, serving {self.weights_label})"


@dataclass(frozen=True)
class Rollout:
    """`GET /v1/pool/rollout`, typed. `state`: Pending (the operator has not observed this spec
    yet), RollingOut, Complete, Stopped."""

    pool: str
    generation: int | None
    observed_generation: int | None
    target_label: str | None
    checkpoint: str | None
    step: int | None
    state: str
    reason: str | None
    message: str | None
    stopped_replica: str | None
    desired: int | None
    updated: int
    ready: int
    replicas: tuple[ReplicaRollout, ...]
    # The pool object's version this was read at (None from a gateway without the long poll).
    resource_version: str | None = None

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Rollout:
        reps = tuple(ReplicaRollout(str(r.get("name")), r.get("phase"), r.get("weights_label"), r.get("state"),
                                    bool(r.get("draining"))) for r in d.get("replicas") or [])
        return cls(pool=str(d.get("pool")), generation=d.get("generation"),
                   observed_generation=d.get("observed_generation"), target_label=d.get("target_label"),
                   checkpoint=d.get("checkpoint"), step=d.get("step"), state=str(d.get("state")),
                   reason=d.get("reason"), message=d.get("message"), stopped_replica=d.get("stopped_replica"),
                   desired=d.get("desired"), updated=int(d.get("updated") or 0), ready=int(d.get("ready") or 0),
                   replicas=reps, resource_version=d.get("resource_version"))

    def observed(self, generation: int | None) -> bool:
        """The operator has acted on the spec of `generation` (or a later one)."""
        return generation is None or (self.observed_generation is not None and self.observed_generation >= generation)


@dataclass(frozen=True)
class AdapterPushed:
    """`POST /v1/pool/adapters`, typed: the version as the pool declared it, servable when returned.
    `model` names it on the OpenAI routes (`<run>@<step>`), `model_path` in Tinker's
    `create_sampling_client(model_path=...)`; `engine_name` is what the replicas load it as."""

    run: str
    step: int
    version_label: str
    model: str
    model_path: str
    engine_name: str
    servable: str  # one | all

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> AdapterPushed:
        return cls(run=str(d.get("run")), step=int(d.get("step") or 0), version_label=str(d.get("version_label")),
                   model=str(d.get("model")), model_path=str(d.get("model_path")),
                   engine_name=str(d.get("engine_name")), servable=str(d.get("servable")))


class RolloutStopped(PoolError):
    """A replica refused the pushed weights; the pool goes on serving what it served before."""

    def __init__(self, label: str, rollout: Rollout) -> None:
        self.label, self.rollout = label, rollout
        self.replica = rollout.stopped_replica
        self.reason = rollout.message or rollout.reason or "stopped"
        super().__init__(f"the rollout of {label!r} stopped at replica {self.replica}: {self.reason}")


class RolloutSuperseded(PoolError):
    """The pool's target changed to other weights while this push was waited for."""

    def __init__(self, label: str, rollout: Rollout) -> None:
        self.label, self.rollout = label, rollout
        super().__init__(f"the rollout of {label!r} was superseded: the pool's target is now "
                         f"{rollout.target_label!r} (another push)")


class RolloutTimeout(PoolError):
    def __init__(self, label: str, timeout_s: float, rollout: Rollout | None) -> None:
        self.label, self.rollout = label, rollout
        where = (f"{rollout.updated}/{rollout.desired} replicas updated, state {rollout.state}"
                 + "".join(f"; {r.line()}" for r in rollout.replicas)) if rollout else "no answer from the gateway"
        super().__init__(f"the rollout of {label!r} did not complete within {timeout_s:g} s: {where}")


def progress_lines(old: Rollout | None, new: Rollout) -> list[str]:
    """Pure: one line per replica whose state, phase or weights changed since `old`, and one when
    the rollout's own state changed."""
    before = {r.name: r for r in old.replicas} if old else {}
    lines = [r.line() for r in new.replicas if before.get(r.name) != r]
    if old is None or (old.state, old.message) != (new.state, new.message):
        lines.append(f"rollout {new.state}: {new.updated}/{new.desired} updated to {new.target_label}"
                     + (f" ({new.message})" if new.message and new.state == "Stopped" else ""))
    return lines


def _seconds(header: str | None) -> float | None:
    """Pure: a Retry-After in seconds (its date form is not used by the gateway)."""
    try:
        return max(0.0, float(header)) if header is not None else None
    except ValueError:
        return None


class Pool:
    def __init__(self, url: str, admin_key: str | None, *, request_timeout_s: float = 30.0,
                 poll_interval_s: float = POLL_INTERVAL_S) -> None:
        self.url = url.rstrip("/")
        self.admin_key = admin_key
        self.request_timeout_s = request_timeout_s
        self.poll_interval_s = poll_interval_s
        self._pusher: Any = None  # weight_transfer.NetworkPusher, once push_weights is used

    def push_weights(self, weights: Any, label: str | None = None, *, step: int | None = None,
                     in_flight: str | None = None, kv: str | None = None, master_address: str | None = None,
                     **wire: Any) -> Any:
        """Push `weights` (a torch module, a state dict, (name, tensor) pairs, or a vLLM `WeightSource`)
        over the network with vLLM's weight-transfer protocol; returns once it serves them under `label`
        (default: `sha256-` and the start of their digest), with what was sent (a `PushResult`: the model
        digest, tensors, bytes, seconds). `step`, `in_flight` (drain, abort, keep) and `kv` as for a
        checkpoint load. The transfer group is kept between pushes. Needs torch and vLLM (imported here,
        not by `import sampler_client`). `url` is a pool's gateway (the push goes to every replica routed to;
        with a SamplerPool it returns once the pool's rollout of `label` is complete, in the pool's
        rollout.mode: `in_flight`, if given, must be it) or one replica's (docs/design/weights-over-network.md)."""
        from .weight_transfer import NetworkPusher

        if self._pusher is None:
            self._pusher = NetworkPusher(self.url, self.admin_key, master_address=master_address, **wire)
        return self._pusher.push(weights, label, step=step, in_flight=in_flight, kv=kv)

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None,
              timeout_s: float | None = None) -> dict[str, Any]:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if data is not None else {}
        if self.admin_key:
            headers["X-API-Key"] = self.admin_key
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout_s or self.request_timeout_s) as resp:
                out: dict[str, Any] = json.loads(resp.read())
                return out
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                err = json.loads(raw).get("error") or {}
            except (ValueError, AttributeError):
                err = {}
            raise RequestRefused(e.code, str(err.get("category") or e.reason),
                                 str(err.get("message") or raw.decode(errors="replace")), err.get("field"),
                                 _seconds(e.headers.get("Retry-After"))) from None
        except (urllib.error.URLError, OSError) as e:
            raise PoolError(f"cannot reach the gateway at {self.url}: {e}") from None

    def status(self) -> Rollout:
        """The pool's rollout now: its target, its state, and every replica's."""
        return Rollout.from_json(self._call("GET", "/v1/pool/rollout"))

    def _next_status(self, after: str | None, wait_s: float) -> Rollout:
        """The rollout once the pool is no longer at version `after` (a long poll of up to `wait_s`)."""
        if after is None or wait_s <= 0:
            return self.status()
        query = urllib.parse.urlencode({"after": after, "wait_s": f"{wait_s:.3f}"})
        return Rollout.from_json(self._call("GET", f"/v1/pool/rollout?{query}"))

    def push(self, checkpoint: str, label: str, step: int | None = None, *, wait: bool = True,
             timeout: float = DEFAULT_TIMEOUT_S, sha256_manifest: dict[str, str] | None = None,
             progress: Progress = True) -> Rollout:
        """Make `checkpoint` the pool's weights, labelled `label`. With `wait`, return once every
        replica serves it; raise `RolloutStopped` (a replica refused it), `RolloutSuperseded` (another
        push), `RolloutTimeout`. A refused push (`RequestRefused`, a 4xx naming the field) leaves the
        pool unchanged."""
        body: dict[str, Any] = {"checkpoint": checkpoint, "version_label": label}
        if step is not None:
            body["step"] = step
        if sha256_manifest is not None:
            body["sha256_manifest"] = sha256_manifest
        pushed = Rollout.from_json(self._call("POST", "/v1/pool/weights", body))
        if not wait:
            return pushed
        return self.wait(label, pushed.generation, timeout=timeout, progress=progress, pushed=pushed)

    def push_adapter(self, run: str, path: str, label: str, step: int, *,
                     sha256_manifest: dict[str, str] | None = None, pinned: bool = False,
                     servable: str = "one", timeout: float = ADAPTER_PUSH_TIMEOUT_S) -> AdapterPushed:
        """Declare version `label` (training `step`) of run `run`'s LoRA adapter, from the PEFT
        directory `path` inside the replicas' pods. Returns once it is servable: loaded and routable on
        one replica (`servable="one"`), or on every replica holding a version of the run (`"all"`).
        A refusal raises `RequestRefused` and leaves the pool unchanged: a 400 naming `run`, `path`
        or a field, the replica's 400 naming the file and tensor (rank, target modules, a corrupt
        file), a 409 naming `step` (not newer than the run's newest), `version_label` or `pinned`.
        Sending the same push again (a lost answer) answers as the first did, so a transient refusal
        (`RequestRefused.transient`: the replicas' slots all busy for a moment, a replica lost
        mid-push) is sent again after its Retry-After while `timeout` has not passed since the first,
        then raised. Each call may take up to `timeout`."""
        body: dict[str, Any] = {"run": run, "path": path, "version_label": label, "step": step}
        if sha256_manifest is not None:
            body["sha256_manifest"] = sha256_manifest
        if pinned:
            body["pinned"] = True
        if servable != "one":
            body["servable"] = servable
        deadline = time.monotonic() + timeout
        while True:
            try:
                return AdapterPushed.from_json(self._call("POST", "/v1/pool/adapters", body, timeout_s=timeout))
            except RequestRefused as e:
                pause = e.retry_after_s if e.retry_after_s is not None else 1.0
                if not e.transient or time.monotonic() + pause >= deadline:
                    raise
                time.sleep(pause)

    def wait(self, label: str, generation: int | None = None, *, timeout: float = DEFAULT_TIMEOUT_S,
             progress: Progress = True, pushed: Rollout | None = None) -> Rollout:
        """Wait for the rollout of `label` (pushed at pool `generation`) to complete. `pushed`: the
        push's own answer, reported first, so the progress always starts where the push left the pool
        (a fast rollout can otherwise be Complete by the first read)."""
        deadline = time.monotonic() + timeout
        last: Rollout | None = None
        with _reporter(progress) as report:
            if pushed is not None:
                for line in progress_lines(None, pushed):
                    report(line, pushed)
                last = pushed
            while True:
                seen = last.resource_version if last is not None else None
                # A long poll when the gateway has one: the answer comes when the pool changes.
                wait_s = min(LONG_POLL_S, self.request_timeout_s / 2, max(0.0, deadline - time.monotonic()))
                moved = False
                try:
                    now = self._next_status(seen, wait_s)
                except PoolError as e:
                    if isinstance(e, RequestRefused) and e.status < 500:
                        raise
                    report(f"gateway unavailable, reading again: {e}", last)
                else:
                    moved = now.resource_version is not None and now.resource_version != seen
                    if now.target_label != label:
                        raise RolloutSuperseded(label, now)
                    for line in progress_lines(last, now):
                        report(line, now)
                    last = now
                    if now.observed(generation) and now.state == "Complete":
                        return now
                    if now.observed(generation) and now.state == "Stopped":
                        raise RolloutStopped(label, now)
                if time.monotonic() >= deadline:
                    raise RolloutTimeout(label, timeout, last)
                if not moved:   # no long poll (or it ran out, or the gateway is away): read again later
                    time.sleep(self.poll_interval_s)


Report = Callable[[str, Rollout | None], None]


@contextmanager
def _reporter(progress: Progress) -> Iterator[Report]:
    if progress is False:
        yield lambda line, rollout: None
        return
    if callable(progress):
        sink = progress
        yield lambda line, rollout: sink(line)
        return
    bar = _tqdm_bar()
    if bar is None:
        yield lambda line, rollout: print(line, file=sys.stderr, flush=True)
        return
    try:
        def report(line: str, rollout: Rollout | None) -> None:
            if rollout is not None and rollout.desired:
                bar.total = rollout.desired
                bar.n = rollout.updated
            bar.set_description_str(line[:80])
            bar.refresh()
        yield report
    finally:
        bar.close()


def _tqdm_bar() -> Any:
    """A tqdm bar when a person watches (stderr is a terminal) and tqdm is installed; else None."""
    if not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=1, unit="replica", file=sys.stderr)
