"""A real RL loop against a sampler pool: what a trainer using this project does, small enough for a CPU.

Each step samples groups through the pool's gateway with the real Tinker SDK, scores them with a toy
reward (the share of completion tokens whose id is in a target range), takes a policy-gradient step
on the model with torch (REINFORCE with group-normalized advantages, as GRPO, and Adam), writes the new weights as
safetensors to the checkpoints volume and pushes them with `sampler_client`, which returns once every
replica serves them. The next step's samples must all come from those weights: the loop reads each
sequence's weights spans (the `X-Sampler-Weights-Spans` header of Tinker's answers: the SDK's
dataclasses have no field for them) and fails if any token of step t came from other weights than
step t's label. It also fails unless the reward rose. On the tiny random model (512 token ids, the
target range 64 of them, so ~1/8 at first) three updates take it from ~0.14 to 0.5-0.9: the output
layer learns at 5e-2, the rest at 1e-3 (Adam moves every weight by about its lr at first, and 5e-2 on
the whole of a model initialized at std 0.02 scrambles it before the reward can rise).

    python examples/rl_loop.py --gateway http://policy-gateway:8080 --api-key "$KEY" \\
        --admin-key "$ADMIN" --model /models/tiny --checkpoints /mnt/ckpt --pod-checkpoints /checkpoints

**`--push network`** sends the full weights over the network instead, with no checkpoint written and
no volume shared with the replicas (they need none: the pool's template sets `weightTransfer.backend:
gloo` and mounts no checkpoints): each step's parameters go straight from this process's memory into
every replica (`Pool.push_weights`: vLLM's weight-transfer protocol through the gateway, gloo on CPU),
and the call returns once the pool's rollout of the label is complete. The pool declares each push by
its digest (`spec.weights = {versionLabel, step, sha256}`); a replica replaced mid-run catches up from
a peer. The replicas must reach this process's address (it hosts the transfer's group). Needs vLLM
beside torch here (`sampler_client.weight_transfer`).

**`--lora`** trains a LoRA adapter instead (peft, on the frozen base model; `--lora-modules`, default
`lm_head`: on the tiny random model the body barely moves the logits; `--lora-rank` 16, at most the
replicas' `--max-lora-rank`; Adam at 1e-1, which takes the reward from ~0.14 to ~0.7 in three
updates, measured with peft on the tiny model). Each step saves the adapter (a PEFT directory:
`adapter_config.json` + `adapter_model.safetensors`) under `<checkpoints>/<run>/<label>`, pushes it as
a version of run `--run` (`Pool.push_adapter`, which returns once it is servable), and samples
through a new sampling client on the push's `model_path` (`tinker://<run>/sampler_weights/<label>`),
as Tinker's own loop does. It fails unless every sample of step t came from `<run>@<t>`: the
gateway names the adapter version of each Tinker answer in `X-Sampler-Adapter` (a base model answer
names none), so the base model, another version or another run's adapter is caught; and unless the
run's answers arrived in step order (per-run Latest) and the reward rose. Two loops with different
`--run`s share one pool.

`--checkpoints` is the volume as this process sees it, `--pod-checkpoints` as the replicas see it
(the path pushed); `--push network` needs neither. Without a SamplerPool (a gateway with static
discovery, which has no pool object to push to), `--replica URL` (repeated) loads each replica directly
through its admin route and waits until the gateway routes to all of them at the label (not with
`--lora`: an adapter is pushed to a pool; a network push needs no `--replica`: the gateway sends the
weights to every replica itself). `--summary PATH` writes what was seen as JSON.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import tinker
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tinker import types
from transformers import AutoModelForCausalLM

from sampler_client import Pool

SPANS_HEADER = "x-sampler-weights-spans"
ADAPTER_HEADER = "x-sampler-adapter"  # the pool's adapter version that sampled an answer: <run>@<step>


class SpanRecorder:
    """Reads the weights spans of every Tinker answer off the wire, keyed by sequence id.

    The SDK hides response headers, so this wraps httpx's `AsyncClient.send` (the SDK's transport,
    whichever backend sits below it) while the loop runs. An `asample` answer names the future and
    its sequence ids; the `retrieve_future` answer that completes it carries one spans list per
    sequence, in order. A resubmitted sample is a new future with new ids: the SDK attaches the ids of
    the attempt that produced its result, so the result's ids find exactly their own spans.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sequence_ids: dict[str, list[str]] = {}
        self.spans: dict[str, list[dict[str, Any]]] = {}
        # Per sequence, the adapter version that sampled it (None: the base model); and every
        # adapter answer in the order it arrived, to check that a run's steps never go back.
        self.adapters: dict[str, str | None] = {}
        self.arrivals: list[str] = []
        self._original: Callable[..., Awaitable[httpx.Response]] | None = None

    def __enter__(self) -> SpanRecorder:
        original = httpx.AsyncClient.send
        self._original = original
        recorder = self

        async def send(client: httpx.AsyncClient, request: httpx.Request, **kw: Any) -> httpx.Response:
            response = await original(client, request, **kw)
            await recorder._see(request, response)
            return response

        setattr(httpx.AsyncClient, "send", send)  # noqa: B010 (a method swapped for the run, typed apart)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._original is not None
        setattr(httpx.AsyncClient, "send", self._original)  # noqa: B010

    async def _see(self, request: httpx.Request, response: httpx.Response) -> None:
        path = request.url.path
        if response.status_code != 200:
            return
        if path.endswith("/asample"):
            await response.aread()  # cached: the SDK reads the same bytes afterwards
            body = json.loads(response.content)
            with self._lock:
                self._sequence_ids[body["request_id"]] = list(body["sample_sequence_ids"])
        elif path.endswith("/retrieve_future") and SPANS_HEADER in response.headers:
            request_id = json.loads(request.content)["request_id"]
            spans = json.loads(response.headers[SPANS_HEADER])
            adapter = response.headers.get(ADAPTER_HEADER)
            with self._lock:
                for sequence_id, sequence_spans in zip(self._sequence_ids.get(request_id, []), spans, strict=False):
                    self.spans[sequence_id] = sequence_spans
                    self.adapters[sequence_id] = adapter
                if adapter is not None:
                    self.arrivals.append(adapter)

    def labels_of(self, sequence_id: str) -> set[str]:
        with self._lock:
            if sequence_id not in self.spans:
                raise AssertionError(f"no weights spans were seen for sequence {sequence_id}")
            return {s["label"] for s in self.spans[sequence_id]}

    def adapter_of(self, sequence_id: str) -> str:
        """The adapter version that sampled the sequence, `<run>@<step>`; "base" for the base model."""
        with self._lock:
            if sequence_id not in self.adapters:
                raise AssertionError(f"no answer was seen for sequence {sequence_id}")
            return self.adapters[sequence_id] or "base"


@dataclass
class StepRecord:
    step: int
    label: str
    reward: float
    batch_labels: list[list[str]] = field(default_factory=list)  # per batch (one prompt's group): its labels
    # --lora: per batch, the adapter versions that sampled it (`<run>@<step>`; "base": the base model)
    batch_adapters: list[list[str]] = field(default_factory=list)
    push_s: float | None = None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--gateway", required=True, help="the pool's gateway, e.g. http://policy-gateway:8080")
    p.add_argument("--api-key", required=True, help="the pool's sampling key")
    p.add_argument("--admin-key", required=True, help="the pool's admin key (pushes weights)")
    p.add_argument("--model", type=Path, required=True, help="the base model's directory, as this process sees it")
    p.add_argument("--base-model", help="the model name the replicas serve (default: the gateway's first)")
    p.add_argument("--push", choices=("disk", "network"), default="disk",
                   help="full weights: write a checkpoint to the shared volume and push its path (disk), or send "
                   "the parameters to every replica over the network, no checkpoint and no volume (network)")
    p.add_argument("--checkpoints", type=Path, help="the checkpoints volume, as this process sees it (not with "
                   "--push network)")
    p.add_argument("--pod-checkpoints", help="the same volume as the replicas see it (default: --checkpoints)")
    p.add_argument("--replica", action="append", default=[],
                   help="static pool: load this replica directly (repeat per replica) instead of pushing")
    p.add_argument("--run", default=f"rl{int(time.time())}",
                   help="prefix of the weights labels (<run>-step-<t>); --lora: the adapter's run on the pool")
    p.add_argument("--steps", type=int, default=3, help="policy updates (the loop samples steps + 1 times)")
    p.add_argument("--prompts", type=int, default=4, help="prompts per step; each is one batch")
    p.add_argument("--group-size", type=int, default=8, help="samples per prompt")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--target", default="64:128", help="target token ids LO:HI; reward = their share of a completion")
    p.add_argument("--lora", action="store_true",
                   help="train a LoRA adapter (peft) and push each step as a version of run --run (Pool.push_adapter)")
    p.add_argument("--lora-rank", type=int, default=16, help="--lora: the adapter's rank (at most the replicas' "
                   "--max-lora-rank)")
    p.add_argument("--lora-modules", default="lm_head", help="--lora: the modules adapted, comma-separated")
    p.add_argument("--lr", type=float, help="the output layer's learning rate (default 5e-2); --lora: the "
                   "adapter's (default 1e-1)")
    p.add_argument("--body-lr", type=float, default=1e-3, help="every other weight's learning rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-rise", type=float, default=0.1, help="the last step's reward must beat the first's by this")
    p.add_argument("--push-timeout", type=float, default=600.0)
    p.add_argument("--summary", type=Path, help="write the steps seen (rewards, labels) here as JSON")
    return p.parse_args(argv)


def log(line: str) -> None:
    print(line, flush=True)


SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}
Tensors = dict[str, tuple[tuple[int, ...], str]]  # name -> (shape, dtype)


def base_tensors(model_dir: Path) -> Tensors:
    out: Tensors = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():  # noqa: SIM118 (safe_open is not a mapping)
                sl = st.get_slice(k)
                out[k] = (tuple(sl.get_shape()), SAFETENSORS_DTYPES.get(sl.get_dtype(), sl.get_dtype()))
    return out


def save_checkpoint(model: Any, base: Tensors, out: Path) -> None:
    """Write the weights as the replicas expect them (the base's names, shapes and dtypes: a replica
    refuses anything else), whole or not at all: into a sibling directory first, renamed into place,
    so a replica never reads half a file."""
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    got: Tensors = {k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in state.items()}
    if got != base:
        diff = sorted(set(got.items()) ^ set(base.items()))[:4]
        raise SystemExit(f"the trainer's tensors differ from the base model's: {diff}")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    # The replicas read the volume as another user: readable by all, whatever this process's umask.
    tmp.chmod(0o755)
    (tmp / "model.safetensors").chmod(0o644)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


class Pusher:
    """The pool's side of a step: push a checkpoint's path through the gateway (a SamplerPool), or load each
    replica of a static pool directly and wait until the gateway routes to all of them at the label; or
    (`--push network`) send the parameters themselves through the gateway."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.pool = Pool(args.gateway, args.admin_key)

    def push_network(self, model: Any, label: str, step: int) -> str:
        """Send the parameters to every replica through the gateway (the transfer's group is kept from step to
        step); returns once the pool serves them under `label`. The model digest the pool declared."""
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        sent = self.pool.push_weights(state, label, step=step)
        log(f"  pushed {label} over the network: {sent.tensors} tensors, {sent.bytes / 1e6:.1f} MB sent in "
            f"{sent.send_s:.2f}s, sha256 {sent.sha256[:16]}; every replica serves it")
        return str(sent.sha256)

    def push(self, pod_path: str, label: str, step: int) -> None:
        if not self.args.replica:
            done = self.pool.push(pod_path, label, step=step, timeout=self.args.push_timeout)
            log(f"  pushed {label}: rollout {done.state}, {done.updated}/{done.desired} replicas at it")
            return
        for url in self.args.replica:
            r = httpx.post(url.rstrip("/") + "/v1/checkpoints/load", json={"path": pod_path, "version_label": label},
                           headers={"X-API-Key": self.args.admin_key}, timeout=self.args.push_timeout)
            if r.status_code != 200:
                raise SystemExit(f"{url} refused {label}: {r.status_code} {r.text}")
        deadline = time.monotonic() + self.args.push_timeout
        want = len(self.args.replica)
        while True:
            # The gateway reads each replica's /health on its own schedule: wait for its view, not ours.
            h = httpx.get(self.args.gateway + "/health", timeout=10).json()
            if sum(r["eligible"] and r["weights_label"] == label for r in h["replicas"]) == want:
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"the gateway never routed to {want} replicas at {label}: {h}")
            time.sleep(0.1)
        log(f"  loaded {label} on {want} replicas")


def reward_of(tokens: list[int], lo: int, hi: int) -> float:
    return sum(lo <= t < hi for t in tokens) / max(len(tokens), 1)


class FullWeights:
    """The whole model trained and pushed as a checkpoint; sampled through the base model's name, so
    each step's samples must carry that step's weights label (its weights spans)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        self.base = base_tensors(args.model)
        head = {id(p) for p in self.model.get_output_embeddings().parameters()}
        params = list(self.model.parameters())
        self.opt = torch.optim.Adam([
            {"params": [p for p in params if id(p) in head], "lr": 5e-2 if args.lr is None else args.lr},
            {"params": [p for p in params if id(p) not in head], "lr": args.body_lr}])
        self.pusher = Pusher(args)
        self._client: Any = None
        self.pushed: dict[str, str] = {}  # --push network: label -> the model digest the pool declared

    def save_and_push(self, step: int, label: str, pod_root: str) -> None:
        if self.args.push == "network":
            self.pushed[label] = self.pusher.push_network(self.model, label, step)
            return
        save_checkpoint(self.model, self.base, self.args.checkpoints / label)
        self.pusher.push(f"{pod_root}/{label}", label, step)

    def sampling_client(self, sc: tinker.ServiceClient, base_model: str) -> Any:
        if self._client is None:
            self._client = sc.create_sampling_client(base_model=base_model).result()
        return self._client

    def wrong(self, step: int, label: str, labels: list[str], adapters: list[str]) -> str | None:
        return None if labels == [label] else f"a batch was sampled at {labels}, not {label}"


class LoraAdapter:
    """A LoRA adapter (peft) trained on the frozen base model, each step pushed as a version of run
    `--run` (`Pool.push_adapter`), then sampled through a new sampling client on the push's
    `model_path`, as Tinker's loop does. Each step's samples must come from exactly that version (the
    `X-Sampler-Adapter` header of Tinker's answers): never the base model, another version or another
    run. The adapter sits on the output layer: the tiny random model's body barely moves its logits."""

    def __init__(self, args: argparse.Namespace) -> None:
        from peft import LoraConfig, get_peft_model  # only this mode needs peft

        self.args = args
        base = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        # lora_alpha 2r, as PEFT's examples; B starts at zero, so step 0's version samples as the base model.
        config = LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, lora_dropout=0.0,
                            target_modules=args.lora_modules.split(","))
        self.model = get_peft_model(base, config)
        self.opt = torch.optim.Adam([p for p in self.model.parameters() if p.requires_grad],
                                    lr=1e-1 if args.lr is None else args.lr)
        self.pool = Pool(args.gateway, args.admin_key)
        self.model_path = ""

    def save_and_push(self, step: int, label: str, pod_root: str) -> None:
        out = self.args.checkpoints / self.args.run / label
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        # adapter_config.json + adapter_model.safetensors: the LoRA tensors alone (peft would add the
        # base output layer itself, which the replicas refuse: they hold the base model already).
        self.model.save_pretrained(tmp, save_embedding_layers=False)
        # Whole or not at all (renamed into place), readable by the replicas' user.
        for f in [tmp, *tmp.rglob("*")]:
            f.chmod(0o755 if f.is_dir() else 0o644)
        out.parent.chmod(0o755)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
        done = self.pool.push_adapter(self.args.run, f"{pod_root}/{self.args.run}/{label}", label, step,
                                      timeout=self.args.push_timeout)
        self.model_path = done.model_path
        log(f"  pushed {label}: {done.model} servable on {done.servable} ({done.model_path})")

    def sampling_client(self, sc: tinker.ServiceClient, base_model: str) -> Any:
        return sc.create_sampling_client(model_path=self.model_path).result()

    def wrong(self, step: int, label: str, labels: list[str], adapters: list[str]) -> str | None:
        want = f"{self.args.run}@{step}"
        return None if adapters == [want] else f"a batch was sampled by adapter {adapters}, not {want}"


def went_back(arrivals: list[str], run: str) -> str | None:
    """Run `run`'s answers, in the order they arrived, never on an older step after a newer one
    (the pool's per-run Latest, as this trainer sees it); what went back, else None."""
    newest = -1
    for name in arrivals:
        r, _, step = name.rpartition("@")
        if r != run:
            continue
        if int(step) < newest:
            return f"an answer on {name} arrived after one on {run}@{newest}"
        newest = int(step)
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    lo, hi = (int(x) for x in args.target.split(":"))
    torch.manual_seed(args.seed)
    if args.lora and args.replica:
        raise SystemExit("--lora pushes through a pool's gateway: --replica (a static pool) has no pool to push to")
    if args.push == "network" and (args.lora or args.replica):
        raise SystemExit("--push network sends full weights through the gateway: not with --lora (an adapter is "
                         "pushed as files) nor --replica (the gateway reaches every replica itself)")
    if args.push == "disk" and args.checkpoints is None:
        raise SystemExit("--checkpoints is required: the volume the checkpoints are written to (or --push network)")
    pod_root = (args.pod_checkpoints or str(args.checkpoints)).rstrip("/")
    policy: FullWeights | LoraAdapter = LoraAdapter(args) if args.lora else FullWeights(args)
    model = policy.model
    prompts = [[1, 10 + i, 20 + i, 30 + i] for i in range(args.prompts)]  # equal lengths: one batched forward
    records: list[StepRecord] = []

    def label_of(step: int) -> str:
        return f"{args.run}-step-{step}"

    def save_and_push(step: int) -> float:
        t0 = time.monotonic()
        policy.save_and_push(step, label_of(step), pod_root)
        return time.monotonic() - t0

    how = "of a LoRA adapter" if args.lora else ("pushed over the network" if args.push == "network" else
                                                  "pushed as checkpoints")
    log(f"run {args.run}: {args.steps} updates {how}, {args.prompts} prompts x {args.group_size} samples, "
        f"reward = share of token ids {lo}..{hi - 1}")
    # Step 0's weights are the base model's, pushed under the run's own label so that every step,
    # the first included, is checked against a label that names exactly one set of weights.
    first_push = save_and_push(0)
    sc = tinker.ServiceClient(base_url=args.gateway, api_key=args.api_key)
    try:
        with SpanRecorder() as spans:
            if args.base_model is None:
                rest = tinker.RestClient(base_url=args.gateway, api_key=args.api_key)
                args.base_model = rest.get_server_capabilities().result().supported_models[0].model_name
            for step in range(args.steps + 1):
                label = label_of(step)
                client = policy.sampling_client(sc, args.base_model)
                # stop=[]: every completion is max_tokens long (one batched forward to train on).
                futures = [client.sample(types.ModelInput.from_ints(p), args.group_size,
                                         types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0, stop=[],
                                                              seed=args.seed * 100_000 + step * 100 + i))
                           for i, p in enumerate(prompts)]
                results = [f.result(timeout=600) for f in futures]
                rec = StepRecord(step, label, 0.0, push_s=first_push if step == 0 else records[-1].push_s)
                seqs: list[tuple[list[int], list[int]]] = []
                rewards: list[float] = []
                for p, res in zip(prompts, results, strict=True):
                    batch = sorted(set().union(*(spans.labels_of(s.sequence_id) for s in res.sequences)))
                    adapters = sorted({spans.adapter_of(s.sequence_id) for s in res.sequences})
                    rec.batch_labels.append(batch)
                    rec.batch_adapters.append(adapters)
                    wrong = policy.wrong(step, label, batch, adapters)
                    if wrong is not None:
                        raise AssertionError(f"step {step}: {wrong}")
                    for s in res.sequences:
                        if len(s.tokens) != args.max_tokens:
                            raise AssertionError(f"step {step}: {len(s.tokens)} tokens, not {args.max_tokens}")
                        seqs.append((p, list(s.tokens)))
                        rewards.append(reward_of(list(s.tokens), lo, hi))
                rec.reward = sum(rewards) / len(rewards)
                records.append(rec)
                batches = " ".join(",".join(b) for b in (rec.batch_adapters if args.lora else rec.batch_labels))
                log(f"step {step}: reward {rec.reward:.3f}, batches at {batches}")
                if step == args.steps:
                    break
                train_step(model, policy.opt, seqs, rewards, args.group_size)
                rec_push = save_and_push(step + 1)
                records[-1].push_s = rec_push
            back = went_back(spans.arrivals, args.run)
    finally:
        sc.close("success").result()
    if back is not None:
        raise AssertionError(f"run {args.run}'s answers went back: {back}")
    rise = records[-1].reward - records[0].reward
    if args.summary:
        pushed = policy.pushed if isinstance(policy, FullWeights) else {}
        args.summary.write_text(json.dumps({"run": args.run, "lora": args.lora, "push": args.push,
                                            "steps": [asdict(r) for r in records], "rise": rise,
                                            "adapter_arrivals": spans.arrivals, "pushed_sha256": pushed}))
    every = "every batch from its step's adapter version" if args.lora else "every batch at its step's label"
    log(f"reward {records[0].reward:.3f} -> {records[-1].reward:.3f} ({rise:+.3f}); {every}")
    if rise < args.min_rise:
        raise AssertionError(f"the reward rose by {rise:.3f} only (wanted at least {args.min_rise})")
    return 0


def train_step(model: Any, opt: torch.optim.Optimizer, seqs: list[tuple[list[int], list[int]]],
               rewards: list[float], group: int) -> None:
    """One REINFORCE step: each completion's log-likelihood weighted by its advantage, its reward
    against its group's (minus the group's mean, so a group whose samples all scored alike teaches
    nothing; over the group's spread, so every prompt's group weighs alike whatever its scale)."""
    r = torch.tensor(rewards).view(-1, group)
    advantage = ((r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + 1e-6)).view(-1)
    plen = len(seqs[0][0])
    ids = torch.tensor([p + t for p, t in seqs])
    completions = ids[:, plen:]
    logits = model(ids).logits[:, plen - 1:-1]
    logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, completions.unsqueeze(-1)).squeeze(-1)
    loss = -(advantage.unsqueeze(1) * logprobs).sum() / completions.numel()
    opt.zero_grad()
    loss.backward()
    opt.step()


if __name__ == "__main__":
    sys.exit(main())
