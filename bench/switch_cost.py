"""What the pool's routing switch costs, computed from what the clients saw (pure; issue #24 acceptance 5).

bench/gateway_switch.py runs the real switch (API server, operator, gateways, samplers) and records
every answer the clients got; this module turns those records into the figures docs/benchmarks.md
reports, so the arithmetic is unit-tested (tests/unit/test_bench_switch.py) apart from the run.

Definitions (one rollout moves the pool from label X, `old`, to the next label Y, `new`):

- **capacity dip** (`dip_s`): from the last answer on X received by any client to the first answer
  on Y received by any client, over every gateway. In that span no gateway of the pool returned an
  answer at all: the switch forbids Y before `Open(Y)` and X after the gateway read `Fence(Y)`. It
  ends with a sample's own latency (the first request dispatched under `Open(Y)` must be computed),
  so it is what a client feels, not only the protocol's round trip. Never negative while the
  guarantee holds: an answer on X received after one on Y would be sent before it was returned.
- **a gateway's dark span** (`gateway_dip_s`): the same, per gateway (its own last X to its own
  first Y); the longest over the gateways. A client that talks to one gateway only sees this one.
- **fence** (`fence_s`): the controller's side, from `Fence(Y)` to `Open(Y)` in `status.routing`,
  as a watch of the SamplerPool delivered them to the benchmark.
- **withheld** (`withheld`): answers a gateway did not return because the switch forbade their
  label (`sampler_gateway_stale_responses`, summed over the gateways). Each one is either **re-run**
  once on Y (the first attempt of a sync sample) or answered **resubmit** (503 `no_replica`, "answered
  on weights ... retry": its re-run came back on a forbidden label too); so re-run = withheld minus
  those 503s. None is lost.
- **what the switch adds to what the workload takes**: `dip_over_lull_s`, the dip less the clients'
  own lull (their rhythm before the push: a dip no longer than it cannot be told from it), and
  `beyond_loading_s`, push -> Complete less the time some replica was loading (`busy` over every
  replica's load: validation, drain, stage, write; a batch's loads overlap, batches one after the
  other add up). Under Drain the drain is the mode's own cost: it waits for the samples in flight.
- **aborted**: 503 `aborted` from an Abort rollout's loads (that mode's design, not the switch's);
  the clients resubmit them, as a trainer does.
- **failed**: any other answer but 200 (must be 0). **violations**: answers on a label older than
  one some client had already received when the request was sent (must be 0; sent-after-received
  pairs only, so a late thread cannot raise a false alarm).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from bench.report import RAW

MODES = ("Drain", "Abort", "Keep")
# The message of a 503 whose answer the switch withheld twice (sampler_gateway/forwarding/forward.py).
WITHHELD_TWICE = "answered on weights"


@dataclass(frozen=True)
class Reply:
    """One answer a client got: its own monotonic clock at send and receipt, through which gateway."""

    sent: float
    received: float
    gateway: str
    status: int                # 0: no HTTP answer
    label: str | None          # weights_label of a 200
    category: str | None = None  # error.category of a non-200
    message: str = ""

    @property
    def withheld_twice(self) -> bool:
        return self.status == 503 and self.category == "no_replica" and WITHHELD_TWICE in self.message


@dataclass(frozen=True)
class SwitchCost:
    """One rollout from `old` to `new` in `mode`, under samples of `tokens` tokens."""

    tokens: int
    mode: str
    old: str
    new: str
    dip_s: float
    gateway_dip_s: float
    fence_s: float | None
    rollout_s: float           # the push -> the pool open on `new` with every replica updated
    withheld: int
    resubmit: int
    aborted: int
    failed: int
    violations: int
    loadavg: float
    steal: float
    push_s: float | None = None         # the trainer's Pool.push(wait=True): the call -> Complete, as it returns
    stage_write_s: float | None = None  # the slowest replica's stage + write (its load's trace, `load.done`)
    lull_s: float | None = None         # the clients' widest gap between answers before the push (`lull`)
    loading_s: float | None = None      # some replica loading (`busy` over the loads' spans, drain included)

    @property
    def beyond_s(self) -> float | None:
        """The push -> Complete beyond the slowest replica's stage + write: the protocol's share."""
        return None if self.push_s is None or self.stage_write_s is None else self.push_s - self.stage_write_s

    @property
    def beyond_loading_s(self) -> float | None:
        """The push -> Complete beyond the time some replica was loading: the protocol's share when
        batches go one after the other, each with its drain."""
        return None if self.push_s is None or self.loading_s is None else self.push_s - self.loading_s

    @property
    def dip_over_lull_s(self) -> float | None:
        """The dip less the clients' own lull: what the switch added to the workload's rhythm."""
        return None if self.lull_s is None else self.dip_s - self.lull_s

    @property
    def rerun(self) -> int:
        return self.withheld - self.resubmit


def dip(replies: Iterable[Reply], old: str, new: str, gateway: str | None = None) -> float:
    """Seconds from the last answer on `old` to the first on `new` (received), over every gateway or
    through one. ValueError when either label has no answer: no dip can be told then."""
    ok = [r for r in replies if r.status == 200 and (gateway is None or r.gateway == gateway)]
    last_old = max((r.received for r in ok if r.label == old), default=None)
    first_new = min((r.received for r in ok if r.label == new), default=None)
    if last_old is None or first_new is None:
        raise ValueError(f"no answer on {old if last_old is None else new}"
                         + (f" through {gateway}" if gateway else ""))
    return first_new - last_old


def gateway_dip(replies: Sequence[Reply], old: str, new: str) -> float:
    """The longest dark span of one gateway (each gateway's own last `old` to its own first `new`)."""
    return max(dip(replies, old, new, g) for g in sorted({r.gateway for r in replies}))


def violations(replies: Iterable[Reply], order: Sequence[str]) -> list[Reply]:
    """The answers on a label older (in `order`, oldest first) than the newest one any client had
    received before the answer's request was sent."""
    rank = {label: i for i, label in enumerate(order)}
    ok = [r for r in replies if r.status == 200]
    by_received = sorted(ok, key=lambda r: r.received)
    newest, j, out = -1, 0, []
    for r in sorted(ok, key=lambda r: r.sent):
        while j < len(by_received) and by_received[j].received < r.sent:
            newest = max(newest, rank.get(by_received[j].label or "", -1))
            j += 1
        if rank.get(r.label or "", -1) < newest:
            out.append(r)
    return out


def lull(replies: Iterable[Reply], start: float, end: float) -> float | None:
    """The widest gap between two answers received one after the other in [start, end), while
    nothing switched: the clients' own rhythm. Closed-loop clients that started together finish in
    step, so even a pool that never goes dark leaves each of them this long without an answer; a
    capacity dip no longer than it cannot be told from it. None with fewer than two answers."""
    times = sorted(r.received for r in within(replies, start, end) if r.status == 200)
    return max((b - a for a, b in zip(times, times[1:], strict=False)), default=None)


def busy(spans: Iterable[tuple[float, float]]) -> float:
    """Seconds in which at least one of the (start, end) `spans` ran: the length of their union. The
    loads of one batch overlap and count once; batches one after the other add up."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def within(replies: Iterable[Reply], start: float, end: float) -> list[Reply]:
    """The answers received in [start, end): one rollout's, between its patch and the next one's."""
    return [r for r in replies if start <= r.received < end]


def counts(replies: Iterable[Reply]) -> tuple[int, int, int]:
    """(resubmit, aborted, failed) among the non-200 answers."""
    resubmit = aborted = failed = 0
    for r in replies:
        if r.status == 200:
            continue
        if r.withheld_twice:
            resubmit += 1
        elif r.status == 503 and r.category == "aborted":
            aborted += 1
        else:
            failed += 1
    return resubmit, aborted, failed


def fence_span(seen: Sequence[tuple[float, str, str]], label: str) -> float | None:
    """From the first `Fence` on `label` to the first `Open` on it after that, in (when, phase,
    label) observations of `status.routing` in order; None when either was not seen."""
    fence = next((t for t, phase, lbl in seen if phase == "Fence" and lbl == label), None)
    if fence is None:
        return None
    return next((t - fence for t, phase, lbl in seen if phase == "Open" and lbl == label and t >= fence), None)


def _p50_max(xs: Sequence[float], unit: str = "s", digits: int = 2) -> str:
    if not xs:
        return "-"
    return f"{statistics.median(xs):.{digits}f} / {max(xs):.{digits}f}" + (f" {unit}" if unit else "")


def table(costs: Sequence[SwitchCost], modes: Sequence[str]) -> list[str]:
    """The table per sample length and mode: p50 / max over the rollouts of each figure, sums of the counts."""
    lines = ["| tokens per sample | mode | rollouts | capacity dip, all gateways (p50 / max) | lull before the push "
             "(p50 / max) | longest dark span "
             "of one gateway (p50 / max) | fence, controller (p50 / max) | rollout (p50 / max) | push -> Complete, "
             "trainer (p50 / max) | beyond the slowest stage + write (p50 / max) | answers re-run on Y "
             "(p50 / max) | answered resubmit (p50 / max) | aborted by the load (total) | failed | violations |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for tokens in sorted({c.tokens for c in costs}):
        for mode in modes:
            cs = [c for c in costs if c.mode == mode and c.tokens == tokens]
            if not cs:
                continue
            fences = [c.fence_s for c in cs if c.fence_s is not None]
            lines.append(
                f"| {tokens} | {mode} | {len(cs)} | {_p50_max([c.dip_s for c in cs])} | "
                f"{_p50_max([c.lull_s for c in cs if c.lull_s is not None])} | "
                f"{_p50_max([c.gateway_dip_s for c in cs])} | "
                f"{_p50_max(fences)}{'' if len(fences) == len(cs) else f' ({len(fences)} seen)'} | "
                f"{_p50_max([c.rollout_s for c in cs])} | {_p50_max([c.push_s for c in cs if c.push_s is not None])} | "
                f"{_p50_max([b for c in cs if (b := c.beyond_s) is not None])} | "
                f"{_p50_max([float(c.rerun) for c in cs], '', 0)} | "
                f"{_p50_max([float(c.resubmit) for c in cs], '', 0)} | {sum(c.aborted for c in cs)} | "
                f"{sum(c.failed for c in cs)} | {sum(c.violations for c in cs)} |")
    return lines


def added(costs: Sequence[SwitchCost], modes: Sequence[str]) -> list[str]:
    """What the switch adds to what the workload itself takes, per sample length and mode: the dip
    less the clients' lull, and push -> Complete beyond the replicas' loading (drains included)."""
    lines = ["| tokens per sample | mode | dip less the lull (p50 / max) | loading, drains included (p50 / max) "
             "| push -> Complete beyond the loading (p50 / max) |", "|---|---|---|---|---|"]
    for tokens in sorted({c.tokens for c in costs}):
        for mode in modes:
            cs = [c for c in costs if c.mode == mode and c.tokens == tokens]
            if cs:
                over = [d for c in cs if (d := c.dip_over_lull_s) is not None]
                loading = [c.loading_s for c in cs if c.loading_s is not None]
                beyond = [b for c in cs if (b := c.beyond_loading_s) is not None]
                lines.append(f"| {tokens} | {mode} | {_p50_max(over)} | {_p50_max(loading)} | {_p50_max(beyond)} |")
    return lines


def per_rollout(costs: Sequence[SwitchCost]) -> list[str]:
    """Every rollout's own figures, in the order run (the spread behind the table)."""
    return [f"- {c.old} -> {c.new} ({c.mode}, {c.tokens} tokens): dip {c.dip_s:.2f} s"
            + (f" (lull before the push {c.lull_s:.2f} s)" if c.lull_s is not None else "")
            + f", one gateway {c.gateway_dip_s:.2f} s, fence "
            + (f"{c.fence_s:.2f} s" if c.fence_s is not None else "not seen")
            + f", rollout {c.rollout_s:.2f} s"
            + (f", push -> Complete {c.push_s:.3f} s" if c.push_s is not None else "")
            + (f" (slowest stage + write {c.stage_write_s:.3f} s"
               + (f", loading {c.loading_s:.3f} s" if c.loading_s is not None else "") + ")"
               if c.stage_write_s is not None else "")
            + f", withheld {c.withheld} (re-run {c.rerun}, resubmit {c.resubmit}), "
            f"aborted {c.aborted}, failed {c.failed}, violations {c.violations}, load {c.loadavg:.2f}, "
            f"steal {c.steal:.1%}" for c in costs]


def _range(xs: Sequence[float], fmt: str) -> str:
    return f"{min(xs):{fmt}}-{max(xs):{fmt}} (median {statistics.median(xs):{fmt}})"


def report(costs: Sequence[SwitchCost], *, clients: int, renew_s: float, lease_s: int, commit: str,
           wall_s: float) -> str:
    """The section of docs/benchmarks.md: the setup, the table, the box's state, every rollout."""
    lengths = sorted({c.tokens for c in costs})
    per_mode = {m: sum(c.mode == m and c.tokens == lengths[0] for c in costs) for m in MODES}
    lines = [
        "The pool's routing switch (docs/design/routing-switch.md) under load, for real: "
        "a kube-apiserver (envtest), the operator process, a SamplerPool of 2 sampler processes (fake engine, "
        "about 1 ms a token: the cost measured is the protocol's, not the engine's), 2 gateway processes "
        f"with kube discovery and their own routing Leases (`--routing-renew-s {renew_s:g}`, `--routing-lease-s "
        f"{lease_s}`), {clients} closed-loop clients each alternating its requests between the two gateways, "
        f"samples of " + " and then ".join(str(n) for n in lengths) + " tokens (ignore_eos). "
        f"{len(costs)} rollouts step-N -> step-N+1 ("
        + ", ".join(f"{n} {m}" for m, n in per_mode.items())
        + (", for each length" if len(lengths) > 1 else "") + "; Drain and Abort with maxUnavailable 1; the modes "
        f"shuffled within each round), run in {wall_s / 60:.1f} min.",
        "",
        "Definitions (bench/switch_cost.py): the **capacity dip** is the span from the last answer on the old label "
        "received by any client to the first answer on the new one, through any gateway: no gateway returned "
        "anything in it (it ends with one sample's latency, the first request dispatched after the pool opened the "
        "new label). **Lull**: the widest gap between two answers any clients received, with the pool open on the "
        "old label before the push: the clients' own rhythm, which a dip no longer than it cannot be told from. "
        "**One gateway's dark span**: the same through one gateway; the longest of the two. **Fence**: "
        "`status.routing` from `Fence(Y)` to `Open(Y)`, as a watch delivered it. **Rollout**: the trainer's push "
        "to the pool open on Y with both replicas updated (polled every 0.1 s). **Push -> Complete**: the "
        "trainer's `Pool.push(wait=True)` through a gateway, from the call to its return (the rollout Complete, as "
        "the trainer learns it); **beyond the slowest stage + write**: that less the slowest replica's own stage + "
        "write (its load's `load.done` trace), the share of the operator, the API server and the gateway. "
        "**Re-run**: answers the gateways withheld because the switch forbade their label "
        "(`sampler_gateway_stale_responses`) and ran again on Y; "
        "**resubmit**: those whose re-run was withheld too, answered 503 to the client. **Aborted**: an Abort "
        "load's own \"aborted, resubmit\" answers (that mode's design), resubmitted by the clients. **Failed**: any "
        "other non-200. **Violations**: answers on a label older than one some client had received before sending "
        "the request.",
        "",
        *table(costs, MODES),
        "",
        "What the switch adds to what the workload itself takes: the dip less the clients' lull, and the push "
        "beyond the time some replica was loading (the union of every replica's load, from its `load.done` trace: "
        "validation, drain, stage and write; with maxUnavailable 1 the batches, each with its drain, add up):",
        "",
        *added(costs, MODES),
        "",
        f"1-minute load average before each rollout: {_range([c.loadavg for c in costs], '.2f')}; hypervisor "
        f"steal during each: {_range([c.steal for c in costs], '.1%')}.",
        "",
        RAW,
        f"Measured at commit {commit}. Every rollout, in the order run:",
        "",
        *per_rollout(costs),
    ]
    return "\n".join(lines) + "\n"
