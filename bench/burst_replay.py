"""What a burst's dispatch costs the engines, without the box's noise: the arrivals bench/burst_dispatch.py
recorded (`--dump`), replayed into a model of the engines, deterministic.

    python -m bench.burst_replay DUMP [--cores 2]

The model is burst_dispatch's `steps` fake, simulated instead of run: replica i's engine on core
i mod `--cores`, the engines of one core sharing it evenly while they have work; an engine runs one
step at a time over its whole batch (STEP_MS, plus SEQ_MS per sequence, plus PREFILL_MS_PER_TOKEN per
prompt token prefilled, a group's prompt costing its tail only once the replica has prefilled it), a
request joins at the next step after it arrived and is done after its tokens. Nothing else takes the
cores (the fronts' own CPU, the client's, the answers' way back are left out).

Per front and burst: `wall`, from the client's first send to the last request done (the tok/s a
bench/prefix_routing.py grpo cell divides by), and the same placement with every request arriving at
the first one's time (`at once`): the difference is what the arrivals' spread in time costs, the
placement (which replica, in count and in order) being kept. Medians over the dump's bursts.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass, field

from bench.burst_dispatch import BLOCK, PREFILL_MS_PER_TOKEN, PROMPT_BLOCKS, SEED_GROUP, SEQ_MS, STEP_MS, TAIL

TOKENS = 32                                  # burst_dispatch's max_tokens
PROMPT = PROMPT_BLOCKS * BLOCK + TAIL
DT_MS = 0.25                                 # the simulation's time step

Record = tuple[int, str, float, float]       # seed, replica, sent, arrived (s from the burst's start)


@dataclass
class Seq:
    group: int
    arrived: float
    left: int = TOKENS
    prefilled: bool = False


@dataclass
class Engine:
    core: int
    waiting: list[Seq] = field(default_factory=list)
    running: list[Seq] = field(default_factory=list)
    step: list[Seq] | None = None            # the batch of the step under way
    step_left: float = 0.0                   # its CPU still to run, ms
    cached: set[int] = field(default_factory=set)

    def start_step(self) -> None:
        self.running += self.waiting
        self.waiting = []
        cost = STEP_MS + SEQ_MS * len(self.running)
        for seq in self.running:
            if not seq.prefilled:
                cost += PREFILL_MS_PER_TOKEN * (PROMPT % BLOCK if seq.group in self.cached else PROMPT)
                self.cached.add(seq.group)
                seq.prefilled = True
        self.step, self.step_left = list(self.running), cost


def simulate(records: list[Record], cores: int, at_once: bool = False) -> float:
    """The burst's wall in seconds from its start (module docstring)."""
    arrivals = sorted((arrived * 1000, seed, replica) for seed, replica, _, arrived in records)
    if at_once:
        arrivals = [(arrivals[0][0], seed, replica) for _, seed, replica in arrivals]
    engines = {r: Engine(i % cores) for i, r in enumerate(sorted({r for _, _, r in arrivals}))}
    t, nxt, done = arrivals[0][0], 0, 0
    while done < len(arrivals):
        while nxt < len(arrivals) and arrivals[nxt][0] <= t:
            at, seed, replica = arrivals[nxt]
            engines[replica].waiting.append(Seq(seed // SEED_GROUP, at))
            nxt += 1
        busy: dict[int, int] = {}
        for e in engines.values():
            if e.step is None and (e.waiting or e.running):
                e.start_step()
            if e.step is not None:
                busy[e.core] = busy.get(e.core, 0) + 1
        for e in engines.values():
            if e.step is None:
                continue
            e.step_left -= DT_MS / busy[e.core]
            if e.step_left <= 0:
                for seq in e.step:
                    seq.left -= 1
                    if seq.left == 0:
                        e.running.remove(seq)
                        done += 1
                e.step = None
        t += DT_MS
    return t / 1000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dump", help="a bench.burst_dispatch --dump file")
    p.add_argument("--cores", type=int, default=2)
    args = p.parse_args()
    with open(args.dump) as f:
        dump: dict[str, list[list[Record]]] = json.load(f)
    print(f"engines on {args.cores} cores; steps of {STEP_MS} ms + {SEQ_MS} ms per sequence + "
          f"{PREFILL_MS_PER_TOKEN} ms per prompt token prefilled; medians over bursts")
    print("| front | wall | wall, arrivals at once | per burst |")
    print("|---|---|---|---|")
    for front, bursts in dump.items():
        walls = [simulate(b, args.cores) for b in bursts]
        once = [simulate(b, args.cores, at_once=True) for b in bursts]
        print(f"| {front} | {statistics.median(walls):.2f} s | {statistics.median(once):.2f} s | "
              f"{', '.join(f'{w:.2f}' for w in walls)} |")


if __name__ == "__main__":
    main()
