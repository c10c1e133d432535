"""The SLA-tier dashboard as a PNG, without Grafana: the same PromQL, drawn with matplotlib.

    python -m loadtests.report --prometheus http://127.0.0.1:9090 --since 10m --out results/sla.png

Each tier gets a row with the SLA dashboard's panels (TTFT p95 and TPOT p95 against the objective,
share within objective, goodput, rejections, requests by key); objectives come from the app config,
exactly as in ``serve_app/ops/dashboards/serve-app-sla.json``. A panel whose query returns nothing is drawn
with "no data" and listed on stderr.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import time
from pathlib import Path

from dashboards.promql import PromQL
from dashboards.queries import Board, Panel, concrete, sla_board
from serve_app.config import load_app_config

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs/local.yaml"
UNIT_SCALE = {"s": (1000.0, "ms"), "percentunit": (100.0, "%"), "reqps": (1.0, "req/s")}


def parse_duration(text: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smh])", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"--since {text!r}: use e.g. 90s, 10m or 1h")
    return float(m.group(1)) * {"s": 1, "m": 60, "h": 3600}[m.group(2)]


def _legend(template: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template).strip()


def fetch(prom: PromQL, panel: Panel, start: float, end: float, step_s: float,
          window: str) -> list[tuple[str, list[float], list[float]]]:
    """(legend, times, values) for each series of each of the panel's queries."""
    out = []
    for t in panel.targets:
        for s in prom.query_range(concrete(t.expr, window), start, end, step_s):
            xs = [float(v[0]) - start for v in s["values"]]
            ys = [float(v[1]) for v in s["values"]]
            out.append((_legend(t.legend, s["metric"]), xs, ys))
    return out


def render(prom: PromQL, board: Board, start: float, end: float, out: Path,
           window: str = "1m") -> list[str]:
    """Draw every panel of ``board``; returns the titles of panels that had no data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    step = max(1.0, (end - start) / 200)
    ncols = max(len(panels) for _, panels in board.rows)
    fig, axes = plt.subplots(len(board.rows), ncols, figsize=(4.2 * ncols, 3.2 * len(board.rows)),
                             squeeze=False)
    empty = []
    for r, (_, panels) in enumerate(board.rows):
        for c in range(ncols):
            ax = axes[r][c]
            if c >= len(panels):
                ax.axis("off")
                continue
            p = panels[c]
            scale, unit = UNIT_SCALE.get(p.unit, (1.0, ""))
            series = fetch(prom, p, start, end, step, window)
            drawn = 0
            for legend, xs, ys in series:
                pts = [(x, y * scale) for x, y in zip(xs, ys, strict=True) if math.isfinite(y)]
                if pts:
                    ax.plot([x for x, _ in pts], [y for _, y in pts], label=legend, linewidth=1.5)
                    drawn += 1
            if p.threshold is not None:
                ax.axhline(p.threshold * scale, color="red", linestyle="--", linewidth=1.2,
                           label=f"objective {p.threshold * scale:g} {unit}")
            if not drawn:
                empty.append(p.title)
                ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", color="grey")
            ax.set_title(p.title, fontsize=9)
            ax.set_xlabel("seconds since start", fontsize=7)
            ax.set_ylabel(unit, fontsize=7)
            ax.tick_params(labelsize=7)
            ax.set_ylim(bottom=0)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=6, loc="upper left")
    fig.suptitle(f"{board.title} ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(start))}, "
                 f"{end - start:.0f} s)", fontsize=11)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return empty


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prometheus", required=True, help="Prometheus base URL")
    p.add_argument("--since", type=parse_duration, default=parse_duration("10m"),
                   help="how far back to draw (e.g. 90s, 10m)")
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG,
                   help="the app config whose tiers and objectives to draw")
    p.add_argument("--window", default="1m", help="rate window of each point (default 1m)")
    p.add_argument("--out", type=Path, default=Path("results/sla-tiers.png"))
    ns = p.parse_args(argv)
    end = time.time()
    board = sla_board(load_app_config(ns.config))
    empty = render(PromQL(ns.prometheus), board, end - ns.since, end, ns.out, ns.window)
    print(f"wrote {ns.out}")
    for title in empty:
        print(f"no data: {title}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
