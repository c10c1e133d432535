"""loadtests.report: argument parsing, legends, and a PNG drawn from a stand-in query client."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from dashboards.queries import sla_board
from loadtests.report import _legend, parse_duration, render
from serve_app.config import load_app_config

ROOT = Path(__file__).resolve().parents[2]


def test_parse_duration() -> None:
    assert (parse_duration("90s"), parse_duration("10m"), parse_duration("1h")) == (90, 600, 3600)
    with pytest.raises(argparse.ArgumentTypeError):
        parse_duration("ten minutes")


def test_legend_fills_labels() -> None:
    assert _legend("{{model}} {{ reason }}", {"model": "m", "reason": "shed"}) == "m shed"


class _Prom:
    """Answers every range query with one series, except queries for goodput (no data)."""

    def __init__(self) -> None:
        self.exprs: list[str] = []

    def query_range(self, expr: str, start: float, end: float, step_s: float) -> list[dict[str, Any]]:
        self.exprs.append(expr)
        if "goodput" in expr:
            return []
        return [{"metric": {"model": "tiny-chat"}, "values": [[start, "0.1"], [end, "NaN"]]}]


def test_render_draws_every_panel_and_reports_empty_ones(tmp_path: Path) -> None:
    board = sla_board(load_app_config(ROOT / "configs/local.yaml"))
    prom = _Prom()
    out = tmp_path / "sla.png"
    empty = render(prom, board, 1000.0, 1600.0, out, window="1m")  # type: ignore[arg-type]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(prom.exprs) == sum(len(p.targets) for p in board.panels())
    assert all("$__rate_interval" not in e and "[1m]" in e for e in prom.exprs)
    assert empty == []  # the goodput panels also hold "all requests", which has data
