"""Read the rollout trace (sampler_common/rollout_trace.py) of a run: where each rollout's time went.

    python -m bench.rollout_trace DIR [--timelines N]
    python -m bench.rollout_trace DIR --picture OUT.png [--mode Keep] [--rollout N]

DIR holds `operator.log` and `gateway-*.log` (what `python -m bench.gateway_rollout --trace` leaves
beside its figures). The lines of every log are merged by their wall-clock `t`; each rollout starts at
the operator's `pool.target` (it saw the push) and runs to the next one. Printed: per rollout the
offset of each milestone from that start, and the median over rollouts per mode; with
`--timelines N`, the first N rollouts' merged lines (answers held and released summed, not listed).

With `--picture`, one rollout (the Nth, from 1, of those in `--mode`, or of all) is drawn instead as a
timeline (bench/plots.py rollout_timeline): one lane per process (the operator, each replica's load as
the operator sees it, each gateway), each step a labelled point at its offset from `pool.target`, the
fence shaded. The capacity dip is not drawn: it is defined by the last answer on the old label any
client received (bench/switch_cost.py), and the trace logs no answer on the old label.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.timeline import Lane, Mark, Span, Timeline

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
    before: str = "?"  # the label the pool was moving from (the previous target)

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


# A sampler's `load.done` timings (sampler_pod's load route).
TIMINGS = ("validation_s", "stage_s", "drain_wait_s", "write_s", "paused_s")
# The parts of a load one after the other on the pod (`paused_s` lies within them): its whole span.
LOAD_PARTS = ("validation_s", "stage_s", "drain_wait_s", "write_s")


def load_span(load: dict[str, float]) -> tuple[float, float]:
    """(start, end) wall-clock seconds of one of `pod_loads`' loads: it ended at its `load.done`
    line's `t` (`done_t`) after its parts, one after the other."""
    return load["done_t"] - sum(load.get(k, 0.0) for k in LOAD_PARTS), load["done_t"]


def pod_loads(pods: Path, label: str, replicas: int = 2, timeout_s: float = 30.0) -> list[dict[str, float]]:
    """Each replica's load of `label` as its trace says (`load.done`, the last one per pod: its TIMINGS
    and its `t` as `done_t`), from the process kubelet's pod logs (`<pods>/<pod>/sampler.log`; the
    pods run with SAMPLER_ROLLOUT_TRACE=1). A log line may lag the load's answer: read again until
    every replica's is there."""
    deadline = time.monotonic() + timeout_s
    while True:
        found: dict[str, dict[str, float]] = {}
        for log in sorted(pods.glob("*/sampler.log")):
            for step in read([log]):
                if step.step == "load.done" and step.fields.get("label") == label:
                    found[log.parent.name] = {**{k: float(step.fields[k]) for k in TIMINGS if k in step.fields},
                                              "done_t": step.t}
        if len(found) >= replicas or time.monotonic() > deadline:
            assert len(found) >= replicas, f"the trace has {len(found)} loads of {label}: {sorted(found)}"
            return list(found.values())
        time.sleep(0.1)


def rollouts(steps: list[Step]) -> list[Rollout]:
    out: list[Rollout] = []
    for s in steps:
        if s.step == "pool.target" and s.who == "operator":
            before = out[-1].label if out else "?"
            out.append(Rollout(s.fields.get("label", "?"), s.fields.get("mode", "?"), s.t, before=before))
        if out:
            out[-1].steps.append(s)
    return out[1:]  # the first target is the pool's creation, not a rollout


# The steps drawn as a fixed mark: (label, kind). Steps that also open or close a span are drawn in
# `timeline` itself.
OPERATOR_MARKS = {
    "routing.fence_written": ("Fence(Y) written", "routing"),
    "routing.acknowledged": ("every ack seen", "routing"),
    "routing.open_written": ("Open(Y) written", "routing"),
    "rollout.ended": ("rollout ended", "routing"),
}
REPLICA_MARKS = {  # the operator's view of each replica's load
    "replica.spec_written": ("spec written", "load"),
    "load.started": ("load sent", "load"),
    "load.recorded": ("status written", "load"),
    "replica.routable": ("routable", "routing"),
}
GATEWAY_MARKS = {
    "answer.first": ("first answer on Y", "answer"),
    "answer.withheld": ("answer withheld", "answer"),
}


def _short(name: str) -> str:
    # the operator names a replica `namespace/name` in its load steps and `name` in its pool steps
    return name.rsplit("/", 1)[-1]


def timeline(r: Rollout) -> Timeline:
    """Where each step of one rollout goes in the picture: the operator's pool steps on its lane, each
    replica's spec, load and status steps on that replica's lane, each gateway's on its own."""
    ms = {id(s): (s.t - r.start) * 1000 for s in r.steps}
    fence_gen = next((s.fields.get("gen") for s in r.steps if s.step == "routing.fence_written"), None)
    open_gen = next((s.fields.get("gen") for s in r.steps if s.step == "routing.open_written"), None)
    operator = Lane("operator")
    replicas: dict[str, Lane] = {}
    gateways: dict[str, Lane] = {}
    load_sent: dict[str, float] = {}
    fenced_at: dict[str, float] = {}

    def replica(s: Step) -> Lane:
        name = _short(s.fields.get("replica", "?"))
        return replicas.setdefault(name, Lane(f"replica {name}\n(operator's view)"))

    for s in r.steps:
        t = ms[id(s)]
        if s.who == "operator":
            if s.step == "pool.target":
                operator.marks.append(Mark(t, f"push seen ({r.mode})", "routing"))
            elif s.step in OPERATOR_MARKS:
                operator.marks.append(Mark(t, *OPERATOR_MARKS[s.step]))
            elif s.step == "load.answered":
                outcome = s.fields.get("outcome", "DONE")
                lane = replica(s)
                lane.marks.append(Mark(t, "load answered" + ("" if outcome == "DONE" else f" {outcome}"), "load"))
                sent = load_sent.pop(_short(s.fields.get("replica", "?")), None)
                if sent is not None:
                    lane.spans.append(Span(sent, t, "load"))
            elif s.step in REPLICA_MARKS:
                replica(s).marks.append(Mark(t, *REPLICA_MARKS[s.step]))
                if s.step == "load.started":
                    load_sent[_short(s.fields.get("replica", "?"))] = t
            continue
        if not s.who.startswith("gateway/"):
            continue
        gw = s.who.split("/", 1)[1]
        lane = gateways.setdefault(gw, Lane(f"gateway {gw}"))
        gen = s.fields.get("gen")
        if s.step == "routing.seen":
            phase = s.fields.get("phase", "?")
            lane.marks.append(Mark(t, f"saw {phase}", "routing"))
            if phase == "Fence":
                fenced_at[gw] = t
            elif phase == "Open" and gw in fenced_at:
                lane.spans.append(Span(fenced_at.pop(gw), t, "fenced"))
        elif s.step == "ack.written":
            phase = "Fence" if gen == fence_gen else "Open" if gen == open_gen else f"gen {gen}"
            lane.marks.append(Mark(t, f"ack {phase}", "routing"))
        elif s.step in GATEWAY_MARKS:
            lane.marks.append(Mark(t, *GATEWAY_MARKS[s.step]))
        elif s.step == "answer.released":
            # logged once, at the release, with how long it was held: the hold is drawn, not its two ends
            lane.spans.append(Span(t - float(s.fields.get("waited_s", "0")) * 1000, t, "held"))
    fw, ow = r.first("routing.fence_written"), r.first("routing.open_written")
    fence = Span(fw * 1000, ow * 1000, "fence") if fw is not None and ow is not None else None
    notes = ["capacity dip not drawn: the trace logs no answer on the old label, the dip's start"]
    held = [sp for lane in gateways.values() for sp in lane.spans if sp.kind == "held"]
    if held:
        notes.append(f"{len(held)} answers on Y held, longest {max(h.end_ms - h.start_ms for h in held):.0f} ms")
    lanes = [operator, *(replicas[k] for k in sorted(replicas)), *(gateways[k] for k in sorted(gateways))]
    return Timeline(f"{r.mode} rollout X = {r.before} -> Y = {r.label}", lanes, fence, None, notes)


def pick(rs: list[Rollout], mode: str | None, n: int) -> Rollout:
    """The Nth rollout (from 1) of those in `mode` (all when None)."""
    of = [r for r in rs if mode is None or r.mode == mode]
    if not 1 <= n <= len(of):
        raise SystemExit(f"--rollout {n}: there are {len(of)} rollouts" + (f" in mode {mode}" if mode else ""))
    return of[n - 1]


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dir", type=Path)
    p.add_argument("--timelines", type=int, default=0)
    p.add_argument("--picture", type=Path, help="draw one rollout as a timeline into this PNG instead")
    p.add_argument("--mode", choices=["Drain", "Abort", "Keep"], help="with --picture: a rollout of this mode")
    p.add_argument("--rollout", type=int, default=1, help="with --picture: the Nth (from 1) rollout")
    a = p.parse_args()
    rs = rollouts(read([a.dir / "operator.log", *sorted(a.dir.glob("gateway-*.log"))]))
    if not rs:
        raise SystemExit(f"no rollout trace under {a.dir} (run with --trace)")
    if a.picture:
        from bench.plots import rollout_timeline  # matplotlib only when drawing

        tl = timeline(pick(rs, a.mode, a.rollout))
        rollout_timeline(a.picture, tl)
        print(f"{tl.title}: {a.picture}")
        return
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
