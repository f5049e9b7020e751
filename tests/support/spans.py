"""What a client can check of an answer's `weights_spans` (docs/guide/sampler.md, "Weights spans"), for the
pool's keep-mode tests: a sample that lived through an in-place update carries two spans, and the
gateway's `Latest` policy judges it by the label of its LAST token. So the version order is checked on
that label, read from the spans the client received, not on the answer's `weights_label` alone (which
must agree with it: a disagreement is a bug of its own, reported here).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from tests.support.closed_loop import Answer


def sequences(a: Answer) -> list[dict[str, Any]]:
    return [s for r in a.body.get("results") or [] for s in r.get("sequences") or []]


def span_problems(a: Answer, order: list[str], max_tokens: int) -> list[str]:
    """Why the sequences of a 200 answer are not whole, exactly covered samples with spans in label
    order (`order`, oldest first); [] when they are. Whole: `max_tokens` tokens, stopped by length
    (ignore_eos), i.e. no sample was cut short by the update."""
    rank = {label: i for i, label in enumerate(order)}
    out = []
    for i, s in enumerate(sequences(a)):
        spans = s.get("weights_spans") or []
        n = len(s.get("tokens") or [])
        if n != max_tokens or s.get("stop_reason") != "length":
            out.append(f"seq {i}: {n} tokens, stop {s.get('stop_reason')} (lost tokens)")
        bounds = [(sp["start"], sp["end"]) for sp in spans]
        if not spans or bounds[0][0] != 0 or bounds[-1][1] != n or any(
                e != nxt for (_, e), (nxt, _) in zip(bounds, bounds[1:], strict=False)) or any(
                b >= e for b, e in bounds):
            out.append(f"seq {i}: spans {bounds} do not cover [0, {n}) exactly")
        ranks = [rank.get(sp["label"], -1) for sp in spans]
        if -1 in ranks or ranks != sorted(set(ranks)):
            out.append(f"seq {i}: span labels {[sp['label'] for sp in spans]} not in the order {order}")
        if spans and s.get("weights_version") != spans[-1]["version"]:
            out.append(f"seq {i}: weights_version {s.get('weights_version')} is not its last span's")
    if not sequences(a):
        out.append("no sequence")
    return out


def last_token_label(a: Answer, order: list[str]) -> str | None:
    """The newest label any sequence's last token came from: what `Latest` judges the answer by."""
    rank = {label: i for i, label in enumerate(order)}
    labels = [s["weights_spans"][-1]["label"] for s in sequences(a) if s.get("weights_spans")]
    return max(labels, key=lambda label: rank.get(label, -1)) if labels else None


def by_last_token(answers: list[Answer], order: list[str]) -> list[Answer]:
    """The 200 answers, each labelled by its last token's spans (for closed_loop.older_after_newer)."""
    return [dataclasses.replace(a, label=last_token_label(a, order)) for a in answers if a.status == 200]


def crossed(a: Answer) -> bool:
    """A sequence of the answer was generated under two weights or more (it lived through a keep load)."""
    return any(len(s.get("weights_spans") or []) > 1 for s in sequences(a))
