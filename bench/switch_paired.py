"""Two commits' routing switch side by side (docs/benchmarks.md, "Routing switch"): run, then read.

    python -m bench.switch_paired run OUT --base DIR --head DIR [--pairs 4] [-- gateway_rollout args]
    python -m bench.switch_paired read OUT

`run` runs `python -m bench.gateway_rollout --no-write ...` from each side's own checkout (its bench
drives its own code), one run at a time, in balanced blocks of two pairs: base, head, head, base;
then head, base, base, head; and so on. Pair k uses seed k (both sides the same schedule of modes).
Each run's output is kept as `OUT/run<i>-<side>.log`.

`read` parses every run's per-rollout lines and prints, per sample length and mode: each side's
p50 / max over its rollouts, and per pair the ratio head / base of the two runs' medians, their
median, and the A/A ratios (the two runs of one side within a block: the spread a ratio must clear
to mean anything). A figure one side does not report (the base's push -> Complete) is left out.
A ratio of two differences ("beyond", "dip over lull") near zero says little: read their p50s.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

LINE = re.compile(r"^- (?P<old>\S+) -> (?P<new>\S+) \((?P<mode>\w+), (?P<tokens>\d+) tokens\): (?P<rest>.*)$")
FIGURES = {  # name -> pattern in a per-rollout line (bench/switch_cost.py `per_rollout`)
    "dip": r"dip ([\d.]+) s",
    "lull": r"lull before the push ([\d.]+) s",
    "fence": r"fence ([\d.]+) s",
    "rollout": r"rollout ([\d.]+) s",
    "push": r"push -> Complete ([\d.]+) s",
    "beyond": None,   # push less the slowest stage + write
    "loading": r"loading ([\d.]+) s",
    "beyond loading": None,  # push less the time some replica was loading (drains included)
    "dip over lull": None,   # the dip less the lull
}
# (run number, side, its rollouts), in the order run.
Runs = list[tuple[int, str, list["Rollout"]]]
RUN_LOG = re.compile(r"^run(?P<i>\d+)-(?P<side>base|head)\.log$")


@dataclass(frozen=True)
class Rollout:
    tokens: int
    mode: str
    figures: dict[str, float]
    load: float


def parse(text: str) -> list[Rollout]:
    out = []
    for line in text.splitlines():
        m = LINE.match(line)
        if not m:
            continue
        rest = m["rest"]
        figures = {name: float(f[1]) for name, pat in FIGURES.items() if pat and (f := re.search(pat, rest))}
        if "push" in figures and (sw := re.search(r"slowest stage \+ write ([\d.]+) s", rest)):
            figures["beyond"] = figures["push"] - float(sw[1])
        if "push" in figures and "loading" in figures:
            figures["beyond loading"] = figures["push"] - figures["loading"]
        if "lull" in figures:
            figures["dip over lull"] = figures["dip"] - figures["lull"]
        load = re.search(r"load ([\d.]+)", rest)
        out.append(Rollout(int(m["tokens"]), m["mode"], figures, float(load[1]) if load else float("nan")))
    return out


def block_order(pairs: int) -> list[tuple[int, str]]:
    """(pair, side) in the order run: blocks of two pairs, base-head head-base, then head-base base-head."""
    out: list[tuple[int, str]] = []
    for k in range(pairs):
        first, second = ("base", "head") if (k // 2) % 2 == k % 2 else ("head", "base")
        out += [(k + 1, first), (k + 1, second)]
    return out


def run(out: Path, base: Path, head: Path, pairs: int, extra: Sequence[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for i, (pair, side) in enumerate(block_order(pairs), start=1):
        tree = base if side == "base" else head
        log = out / f"run{i}-{side}.log"
        env = {**os.environ, "PYTHONPATH": f"{tree}:{tree / 'operator'}"}
        cmd = [str(tree / ".venv/bin/python"), "-m", "bench.gateway_rollout", "--no-write", "--seed", str(pair),
               *extra]
        print(f"run {i} ({side}, pair {pair}): {' '.join(cmd[1:])}", flush=True)
        with log.open("w") as f:
            rc = subprocess.run(cmd, cwd=tree, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
        if rc:
            raise SystemExit(f"run {i} ({side}) failed (exit {rc}): {log}")


def _median(rs: Sequence[Rollout], figure: str) -> float | None:
    xs = [r.figures[figure] for r in rs if figure in r.figures]
    return statistics.median(xs) if xs else None


def _of(runs: Runs, side: str, tokens: int, mode: str, i: int | None = None) -> list[Rollout]:
    return [r for j, s, rs in runs if s == side and (i is None or j == i) for r in rs
            if r.tokens == tokens and r.mode == mode]


def _row(runs: Runs, figure: str, tokens: int, mode: str) -> str:
    def med(side: str, i: int) -> float | None:
        return _median(_of(runs, side, tokens, mode, i), figure)

    def p50_max(side: str) -> str:
        xs = [r.figures[figure] for r in _of(runs, side, tokens, mode) if figure in r.figures]
        return f"{statistics.median(xs):.2f} / {max(xs):.2f}" if xs else "-"

    # Runs 2k-1 and 2k are pair k; a block is 4 runs (two pairs).
    ratios: list[float] = []
    aa: dict[str, list[float]] = {"head": [], "base": []}
    for k in range(0, len(runs) - 1, 2):
        (i1, s1, _), (i2, _, _) = runs[k], runs[k + 1]
        h, b = (i1, i2) if s1 == "head" else (i2, i1)
        mh, mb = med("head", h), med("base", b)
        if mh is not None and mb:
            ratios.append(mh / mb)
    for k in range(0, len(runs) - 3, 4):
        for side in ("head", "base"):
            i1, i2 = [i for i, s, _ in runs[k:k + 4] if s == side][:2]
            m1, m2 = med(side, i1), med(side, i2)
            if m1 is not None and m2:
                aa[side].append(m1 / m2)
    fmt = ", ".join(f"{x:.2f}" for x in ratios)
    return (f"| {tokens} | {mode} | {p50_max('base')} | {p50_max('head')} | "
            + (f"{fmt} (**{statistics.median(ratios):.2f}**)" if ratios else "-")
            + f" | {', '.join(f'{x:.2f}' for x in aa['head']) or '-'} | "
            f"{', '.join(f'{x:.2f}' for x in aa['base']) or '-'} |")


def read(out: Path) -> str:
    runs: Runs = []
    for log in sorted(out.glob("run*-*.log"), key=lambda p: int(RUN_LOG.match(p.name)[1])):  # type: ignore[index]
        m = RUN_LOG.match(log.name)
        if m:
            runs.append((int(m["i"]), m["side"], parse(log.read_text())))
    keys = sorted({(r.tokens, r.mode) for _, _, rs in runs for r in rs})
    lines = []
    for figure in FIGURES:
        lines += [f"### {figure}", "", "| tokens | mode | base p50 / max | head p50 / max | head / base per pair "
                  "(median) | A/A head | A/A base |", "|---|---|---|---|---|---|---|"]
        for tokens, mode in keys:
            lines.append(_row(runs, figure, tokens, mode))
        lines.append("")
    loads = [r.load for _, _, rs in runs for r in rs]
    lines.append(f"1-minute load average before each rollout: {min(loads):.2f}-{max(loads):.2f} "
                 f"(median {statistics.median(loads):.2f}); failed and violations: see each run's log.")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("out", type=Path)
    r.add_argument("--base", type=Path, required=True)
    r.add_argument("--head", type=Path, required=True)
    r.add_argument("--pairs", type=int, default=4)
    rd = sub.add_parser("read")
    rd.add_argument("out", type=Path)
    a, extra = p.parse_known_args()
    if a.cmd == "run":
        run(a.out, a.base.resolve(), a.head.resolve(), a.pairs, [x for x in extra if x != "--"])
    else:
        print(read(a.out))


if __name__ == "__main__":
    main()
