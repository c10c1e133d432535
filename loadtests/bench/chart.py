"""The side-by-side chart of ``loadtests.bench --peers``: output tokens/s and TTFT p50 per side."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loadtests.bench.report import SIDE_NAMES


def plot(summary: dict[int, dict[str, Any]], sides: tuple[str, ...], out: Path, title: str = "") -> Path:
    """Two panels: output tokens/s by concurrency (grouped bars) and TTFT p50 by concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    concs = list(summary)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.8 / max(1, len(sides))
    for j, side in enumerate(sides):
        xs = [i + (j - (len(sides) - 1) / 2) * width for i in range(len(concs))]
        tok = [summary[c].get(side, {}).get("output_tok_s", 0.0) for c in concs]
        ttft = [summary[c].get(side, {}).get("ttft_p50_ms", 0.0) for c in concs]
        ax1.bar(xs, tok, width, label=SIDE_NAMES.get(side, side))
        ax2.bar(xs, ttft, width, label=SIDE_NAMES.get(side, side))
    for ax, label in ((ax1, "output tokens/s (higher is better)"), (ax2, "TTFT p50, ms (lower is better)")):
        ax.set_xticks(range(len(concs)), [f"c{c}" for c in concs])
        ax.set_xlabel("concurrency")
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    ax2.set_yscale("log")
    ax1.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
