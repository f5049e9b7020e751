"""The PNG plots of docs/benchmarks.md, drawn by the benchmark that owns the figures (matplotlib,
headless). Each function takes plain numbers, so a plot is redrawn only by re-running its benchmark."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib
import matplotlib.ticker

from bench.timeline import Timeline, place_labels

matplotlib.use("Agg")  # no display here or in CI; pyplot is imported only after this (see _plt)

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _plt() -> Any:
    import matplotlib.pyplot as plt

    return plt


def throughput_vs_concurrency(path: Path, series: dict[str, dict[int, float]], title: str) -> None:
    """tok/s against concurrency, one line per system (log-2 x axis: 1, 8, 32, 128)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for name, points in series.items():
        xs = sorted(points)
        ax.plot(xs, [points[x] for x in xs], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({x for p in series.values() for x in p}))
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("generated tokens / s (median of rounds)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def replacement_timeline(path: Path, runs: list[tuple[float, float]], title: str) -> None:
    """One bar per run: from the pod's first uncertain answer to its replacement pod existing, then
    to the replica being Ready again."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 0.5 * len(runs) + 1.5), dpi=110)
    for i, (new_pod, ready) in enumerate(runs):
        ax.barh(i, new_pod, color="tab:orange", label="uncertain -> new pod created" if i == 0 else None)
        ax.barh(i, ready - new_pod, left=new_pod, color="tab:green",
                label="new pod created -> replica Ready" if i == 0 else None)
    ax.set_yticks(range(len(runs)), [f"run {i + 1}" for i in range(len(runs))])
    ax.invert_yaxis()
    ax.set_xlabel("seconds after the pod first reported uncertain_weights")
    ax.set_title(title, fontsize=10)
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


_KIND_COLOUR = {"load": "tab:blue", "routing": "tab:red", "answer": "tab:green"}
_SPAN_STYLE = {  # kind: (colour, alpha, bar's bottom and top around its lane's line, legend)
    "load": ("tab:blue", 0.25, -0.10, 0.10, "a replica's load: sent -> answered"),
    "fenced": ("tab:red", 0.30, -0.10, 0.10, "a gateway fenced: saw Fence(Y) -> saw Open(Y)"),
    "held": ("tab:orange", 0.45, -0.32, -0.18, "an answer on Y held until Open(Y)"),
}


def rollout_timeline(path: Path, tl: Timeline) -> None:
    """One rollout's trace (bench/rollout_trace.py timeline): a lane per process, each step a labelled
    point, the fence shaded across every lane. Labels are stacked in rows so that none overlaps
    (bench/timeline.py place_labels)."""
    plt = _plt()
    from matplotlib.patches import Patch

    font = 7
    width_in, lanes_in = 8.0, 6.5  # lanes_in: the axes' width, the lane names left of it
    every = [m.ms for lane in tl.lanes for m in lane.marks] + [
        e for lane in tl.lanes for sp in lane.spans for e in (sp.start_ms, sp.end_ms)]
    left, right = min(0.0, *every), max(every)
    pad = 0.02 * (right - left)
    left, right = left - pad, right + pad
    ms_per_char = (right - left) / (lanes_in / (font * 0.62 / 72))
    row_h, base_h = 0.30, 0.75
    placed = [place_labels(lane.marks, ms_per_char, left, right) for lane in tl.lanes]
    heights = [base_h + row_h * (1 + max((p.row for p in ps), default=0)) for ps in placed]
    fig, ax = plt.subplots(figsize=(width_in, 0.9 + 0.62 * sum(heights)), dpi=110)
    y = sum(heights)
    lines = []
    seen_kinds: list[str] = []
    for lane, ps, h in zip(tl.lanes, placed, heights, strict=True):
        line = y - h + 0.45  # the lane's line: room below for held answers, above for the labels
        lines.append(line)
        ax.axhline(line, color="0.6", lw=0.6, zorder=1)
        for sp in lane.spans:
            colour, alpha, lo, hi, _ = _SPAN_STYLE[sp.kind]
            ax.fill_between([sp.start_ms, sp.end_ms], line + lo, line + hi, color=colour, alpha=alpha, lw=0,
                            zorder=2)
            if sp.kind not in seen_kinds:
                seen_kinds.append(sp.kind)
        for m, p in zip(lane.marks, ps, strict=True):
            ly = line + 0.22 + row_h * p.row
            ax.plot([m.ms, m.ms], [line, ly], color="0.7", lw=0.5, zorder=2)
            ax.plot(m.ms, line, "o", ms=3.5, color=_KIND_COLOUR[m.kind], zorder=3)
            ax.text(m.ms, ly, f"{m.text} {m.ms:.0f}", fontsize=font, ha="right" if p.leftward else "left",
                    va="bottom", zorder=4)
        y -= h
    if tl.fence is not None:
        ax.axvspan(tl.fence.start_ms, tl.fence.end_ms, color="tab:red", alpha=0.08, lw=0, zorder=0)
        fence_ms = tl.fence.end_ms - tl.fence.start_ms
        ax.text((tl.fence.start_ms + tl.fence.end_ms) / 2, sum(heights), f"fence {fence_ms:.0f} ms", fontsize=font,
                ha="center", va="bottom", color="tab:red")
    ax.set_yticks(lines, [lane.name for lane in tl.lanes], fontsize=font + 1)
    ax.set_ylim(0, sum(heights))
    ax.set_xlim(left, right)
    ax.set_xlabel("ms after the operator saw the push (its pool.target)", fontsize=font + 1)
    ax.tick_params(axis="x", labelsize=font)
    ax.grid(True, axis="x", alpha=0.25)
    ax.set_title(tl.title, fontsize=10, pad=14)
    handles = [Patch(color="tab:red", alpha=0.15, label="fence: the operator's Fence(Y) written -> Open(Y) written")]
    handles += [Patch(color=_SPAN_STYLE[k][0], alpha=_SPAN_STYLE[k][1], label=_SPAN_STYLE[k][4]) for k in seen_kinds]
    below_in = 0.45  # the legend below the x axis' label, whatever the picture's height
    axes_h_in = ax.get_position().height * fig.get_figheight()
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(0.0, -below_in / axes_h_in), ncol=2, fontsize=font,
              frameon=False, title="; ".join(tl.notes), title_fontsize=font)
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
