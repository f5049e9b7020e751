"""Read the rollout trace (sampler_common/rollout_trace.py) of a run: where each rollout's time went.

    python -m bench.rollout_trace DIR [--timelines N]

DIR holds `operator.log` and `gateway-*.log` (what `python -m bench.gateway_rollout --trace` leaves
beside its figures). The lines of every log are merged by their wall-clock `t`; each rollout starts at
the operator's `pool.target` (it saw the push) and runs to the next one. Printed: per rollout the
offset of each milestone from that start, and the median over rollouts per mode; with
`--timelines N`, the first N rollouts' merged lines (answers held and released summed, not listed).
"""

from __future__ import annotations

import argparse
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path

LINE = re.compile(r"rollout-trace t=(?P<t>\d+\.\d+) who=(?P<who>\S+) step=(?P<step>\S+)(?P<rest>.*)$")


@dataclass
class Step:
    t: float
    who: str
    step: str
    fields: dict[str, str]


@dataclass
class Rollout:
    label: str
    mode: str
    start: float
    steps: list[Step] = field(default_factory=list)

    def first(self, step: str, **want: str) -> float | None:
        ts = [s.t for s in self.steps if s.step == step and all(s.fields.get(k) == v for k, v in want.items())]
        return min(ts) - self.start if ts else None

    def last(self, step: str, **want: str) -> float | None:
        ts = [s.t for s in self.steps if s.step == step and all(s.fields.get(k) == v for k, v in want.items())]
        return max(ts) - self.start if ts else None

    def each_gateway_last(self, step: str, **want: str) -> float | None:
        """The latest, over the gateways, of each one's first such step: when the last gateway got there."""
        firsts: dict[str, float] = {}
        for s in self.steps:
            if s.step == step and s.who.startswith("gateway/") and all(s.fields.get(k) == v for k, v in want.items()):
                firsts.setdefault(s.who, s.t)
        return max(firsts.values()) - self.start if firsts else None

    def milestones(self) -> dict[str, float | None]:
        y = self.label
        fence = next((s.fields.get("gen") for s in self.steps if s.step == "routing.fence_written"), None)
        opened = next((s.fields.get("gen") for s in self.steps if s.step == "routing.open_written"), None)
        held = [float(s.fields.get("waited_s", "0")) for s in self.steps if s.step == "answer.released"]
        return {
            "replica spec written": self.first("replica.spec_written"),
            "first load started": self.first("load.started", label=y),
            "last load answered": self.last("load.answered", label=y),
            "last load recorded": self.last("load.recorded", label=y),
            "first replica routable on Y": self.first("replica.routable", label=y),
            "Fence(Y) written": self.first("routing.fence_written"),
            "last gateway saw Fence": self.each_gateway_last("routing.seen", phase="Fence", gen=fence or "?"),
            "last gateway acked Fence": self.each_gateway_last("ack.written", gen=fence or "?"),
            "operator saw every ack": self.first("routing.acknowledged", gen=fence or "?"),
            "Open(Y) written": self.first("routing.open_written"),
            "last gateway saw Open": self.each_gateway_last("routing.seen", phase="Open", gen=opened or "?"),
            "first answer on Y returned": self.first("answer.first", label=y),
            "rollout ended": self.first("rollout.ended", label=y),
            "answers held (n)": float(len(held)),
            "longest hold": max(held) if held else None,
        }


def read(paths: list[Path]) -> list[Step]:
    out = []
    for path in paths:
        for raw in path.read_text(errors="replace").splitlines():
            m = LINE.search(raw)
            if m:
                fields = dict(kv.split("=", 1) for kv in m["rest"].split() if "=" in kv)
                out.append(Step(float(m["t"]), m["who"], m["step"], fields))
    return sorted(out, key=lambda s: s.t)


def rollouts(steps: list[Step]) -> list[Rollout]:
    out: list[Rollout] = []
    for s in steps:
        if s.step == "pool.target" and s.who == "operator":
            out.append(Rollout(s.fields.get("label", "?"), s.fields.get("mode", "?"), s.t))
        if out:
            out[-1].steps.append(s)
    return out[1:]  # the first target is the pool's creation, not a rollout


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dir", type=Path)
    p.add_argument("--timelines", type=int, default=0)
    a = p.parse_args()
    rs = rollouts(read([a.dir / "operator.log", *sorted(a.dir.glob("gateway-*.log"))]))
    if not rs:
        raise SystemExit(f"no rollout trace under {a.dir} (run with --trace)")
    names = list(rs[0].milestones())
    modes = sorted({r.mode for r in rs})
    print("| milestone, s after the operator saw the push (median) | " + " | ".join(
        f"{m} ({sum(r.mode == m for r in rs)})" for m in modes) + " |")
    print("|---|" + "---|" * len(modes))
    for name in names:
        cells = []
        for m in modes:
            vals = [v for r in rs if r.mode == m and (v := r.milestones()[name]) is not None]
            cells.append(_fmt(statistics.median(vals)) if vals else "-")
        print(f"| {name} | " + " | ".join(cells) + " |")
    for r in rs[:a.timelines]:
        print(f"\n{r.mode} -> {r.label}")
        for s in r.steps:
            if s.step not in ("answer.held", "answer.released"):
                extra = " ".join(f"{k}={v}" for k, v in s.fields.items())
                print(f"  +{s.t - r.start:7.3f}  {s.who:<14} {s.step:<24} {extra}")
        held = [s for s in r.steps if s.step == "answer.released"]
        if held:
            print(f"  answers held and released: {len(held)}, longest "
                  f"{max(float(s.fields.get('waited_s', '0')) for s in held):.3f} s")


if __name__ == "__main__":
    main()
