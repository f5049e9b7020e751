"""The PNG plots of docs/benchmarks.md, drawn by the benchmark that owns the figures (matplotlib,
headless). Each function takes plain numbers, so a plot is redrawn only by re-running its benchmark."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib
import matplotlib.ticker

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
