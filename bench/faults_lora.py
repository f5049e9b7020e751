"""Faults with LoRA (issue #54): a LoRA pool loses a replica under load. Per round: the requests, how
many failed, how many were run again elsewhere, and how long the survivor took to answer after the
kill.

    python -m bench.faults_lora [--rounds 3] [--before 60] [--after 150] [--no-write]

The setup is tests/support/lora_faults.py's (the issue's): 2 real vLLM CPU replicas (`--max-loras 1
--max-cpu-loras 2`) behind a real gateway whose `--adapters-file` declares 2 runs, 5 versions; six
closed-loop clients, one per name (`ra@1`, `ra@2`, `ra@3`, `rb@1`, `rb@2`, the base model), half on
`/v1/sample`, half on `/v1/completions`. Each round: the load runs (`--before` answers), one replica
is SIGKILLed, the load goes on over the survivor alone (`--after` answers), then the killed replica
is started again on its address (the kubelet's restart) for the next round. Every answer is checked
against Hugging Face + PEFT for the version its name resolves to.

What it reports, per round:
- requests, failed (any answer but a 200), wrong (a 200 whose tokens are not its version's);
- re-run: requests the gateway sent again after the victim was lost: sync samples re-run
  (`X-Sampler-Retried` on the answer), and adapter requests placed again because the victim failed
  or left while their version was being placed (`sampler_gateway_adapter_replaced_total`);
- from the kill to the first answer from the survivor to a request sent before the kill (a request
  the kill caught), and to the last such answer: what the loss cost the requests in the way.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.report import write_section
from sampler_pod.testing.tiny_model import cached_tiny_model
from tests.support.lora_faults import SURVIVOR, VICTIM, Stack, kill_under_load, lora_pool, tokens_of
from tests.support.metrics import metric


@dataclass
class Round:
    requests: int
    failed: int
    wrong: int
    retried: int           # answers with X-Sampler-Retried: re-run after the victim was lost with them
    placed_again: float    # the gateway's adapter_replaced count on the victim, this round
    first_s: float | None  # kill -> the survivor's first answer to a request sent before the kill
    last_s: float | None   # kill -> its last such answer
    loadavg: float


def one_round(stack: Stack, before: int, after: int) -> Round:
    replaced = metric(stack.gw.metrics(), "sampler_gateway_adapter_replaced_total", 0.0, replica=VICTIM)
    run = kill_under_load(stack, before, after)
    answers = [(name, a) for name, got in run.answers.items() for a in got]
    caught = sorted(a.received - run.killed_at for _, a in answers
                    if a.sent < run.killed_at < a.received and a.replica == SURVIVOR)
    return Round(
        requests=len(answers), failed=sum(a.status != 200 for _, a in answers),
        wrong=sum(a.status == 200 and tokens_of(a) != stack.want[name] for name, a in answers),
        retried=sum(a.retried is not None for _, a in answers),
        placed_again=metric(stack.gw.metrics(), "sampler_gateway_adapter_replaced_total", 0.0,
                            replica=VICTIM) - replaced,
        first_s=caught[0] if caught else None, last_s=caught[-1] if caught else None,
        loadavg=os.getloadavg()[0])


def seconds(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def body(rounds: list[Round], a: argparse.Namespace, elapsed_s: float, load0: float) -> str:
    rows = ["| round | requests | failed | wrong | re-run (`X-Sampler-Retried`) | placed again (adapter) | "
            "kill -> survivor's first answer (s) | kill -> last answer caught (s) |",
            "|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(rounds, 1):
        rows.append(f"| {i} | {r.requests:,} | {r.failed} | {r.wrong} | {r.retried} | {r.placed_again:g} | "
                    f"{seconds(r.first_s)} | {seconds(r.last_s)} |")
    firsts = [r.first_s for r in rounds if r.first_s is not None]
    lasts = [r.last_s for r in rounds if r.last_s is not None]
    total = sum(r.requests for r in rounds)
    failed = sum(r.failed for r in rounds) + sum(r.wrong for r in rounds)
    median_first = seconds(statistics.median(firsts) if firsts else None)
    median_last = seconds(statistics.median(lasts) if lasts else None)
    return "\n".join([
        "Per round (one replica SIGKILLed under load):", "", *rows, "",
        f"Run in {elapsed_s:.0f} s on {os.cpu_count()} cores; 1-minute load average {load0:.2f} at the start, "
        f"{rounds[-1].loadavg:.2f} at the end.",
        "",
        "Method: the issue's setup (tests/support/lora_faults.py): 2 real vLLM CPU replicas, the tiny model, "
        "`--max-loras 1 --max-cpu-loras 2` (4 slots for 5 versions), a real gateway with `--adapters-file` "
        "declaring runs `ra` (3 versions) and `rb` (2); six closed-loop clients, one per name (`ra@1`, `ra@2`, "
        "`ra@3`, `rb@1`, `rb@2`, the base model), half on `/v1/sample`, half on `/v1/completions`, greedy, "
        f"12 tokens. Each round: {a.before} answers, SIGKILL of one replica (its whole process group), "
        f"{a.after} more answers over the survivor alone (2 slots for 5 versions: requests wait for a slot "
        "in turn), then the replica started again on its address for the next round. Failed: any answer but "
        "a 200; wrong: a 200 whose tokens differ from Hugging Face + PEFT's for its name's version. Re-run: "
        "a sync sample caught on the victim and run again on the survivor. Placed again: an adapter request "
        "whose placement (its version's unload or load, or the wait for it) was on the victim when it went.",
        "",
        f"Target: 0 failed (met: {'yes' if failed == 0 else 'no'}, {failed} of {total:,}). The survivor's "
        f"first answer to a request the kill caught came {median_first} s after the kill (median of the "
        f"rounds); the last such answer {median_last} s after it: the requests waiting for a slot on the "
        "survivor, where 5 versions take turns on 2.",
    ])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--before", type=int, default=60, help="answers before each kill")
    p.add_argument("--after", type=int, default=150, help="answers after each kill")
    p.add_argument("--no-write", action="store_true", help="print, do not write docs/benchmarks.md")
    a = p.parse_args()
    load0, start = os.getloadavg()[0], time.monotonic()
    rounds = []
    with tempfile.TemporaryDirectory(prefix="bench-faults-lora-") as tmp, \
            lora_pool(cached_tiny_model(), Path(tmp)) as stack:
        for i in range(a.rounds):
            if i:
                stack.restart(VICTIM)
                stack.gw.wait_eligible({SURVIVOR, VICTIM}, timeout=120)
            rounds.append(one_round(stack, a.before, a.after))
            print(rounds[-1], flush=True)
    text = body(rounds, a, time.monotonic() - start, load0)
    print(text)
    if not a.no_write:
        write_section("Faults with LoRA", text, "python -m bench.faults_lora")


if __name__ == "__main__":
    main()
