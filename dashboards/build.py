"""Grafana dashboard JSON from ``dashboards.queries``, through Grafana's own SDK (grafana-foundation-sdk)."""

from __future__ import annotations

import json
from typing import Any

from grafana_foundation_sdk.builders import common as common_b
from grafana_foundation_sdk.builders import dashboard as dash_b
from grafana_foundation_sdk.builders import prometheus as prom_b
from grafana_foundation_sdk.builders import timeseries as ts_b
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as common_m
from grafana_foundation_sdk.models import dashboard as dash_m

from dashboards.queries import Board, Panel

# Matches the uid in provisioning/datasources/prometheus.yaml.
DATASOURCE = dash_m.DataSourceRef(type_val="prometheus", uid="prometheus")
PANEL_SPAN = 8
PANEL_HEIGHT = 8


def _panel(p: Panel) -> ts_b.Panel:
    panel = (
        ts_b.Panel()
        .title(p.title)
        .description(p.description)
        .unit(p.unit)
        .datasource(DATASOURCE)
        .span(PANEL_SPAN)
        .height(PANEL_HEIGHT)
        .min(0)
        .line_width(2)
        .fill_opacity(10)
        .legend(common_b.VizLegendOptions().show_legend(True)
                .display_mode(common_m.LegendDisplayMode.LIST)
                .placement(common_m.LegendPlacement.BOTTOM))
    )
    if p.stacked:  # the parts of one whole (stages of a request): drawn on top of each other
        panel = (panel.stacking(common_b.StackingConfig().mode(common_m.StackingMode.NORMAL))
                 .fill_opacity(60))
    if p.threshold is not None:
        panel = (
            panel.thresholds(dash_b.ThresholdsConfig().mode(dash_m.ThresholdsMode.ABSOLUTE).steps([
                dash_m.Threshold(value=None, color="green"),
                dash_m.Threshold(value=p.threshold, color="red"),
            ]))
            .thresholds_style(common_b.GraphThresholdsStyleConfig()
                              .mode(common_m.GraphThresholdsStyleMode.DASHED))
        )
    for i, t in enumerate(p.targets):
        panel = panel.with_target(
            prom_b.Dataquery().expr(t.expr).legend_format(t.legend).ref_id(chr(ord("A") + i))
            .datasource(DATASOURCE)
        )
    return panel


def build(board: Board) -> dict[str, Any]:
    d = (
        dash_b.Dashboard(board.title)
        .uid(board.uid)
        .description(board.description)
        .tags(["serve-app", "generated"])
        .refresh("10s")
        .time("now-30m", "now")
        .timezone(common_m.TimeZoneBrowser)
        .editable()
    )
    for title, panels in board.rows:
        d = d.with_row(dash_b.Row(title))
        for p in panels:
            d = d.with_panel(_panel(p))
    out: dict[str, Any] = json.loads(JSONEncoder(sort_keys=True).encode(d.build()))
    return out


def render(board: Board) -> str:
    """The committed file's exact text (stable key order, trailing newline)."""
    return json.dumps(build(board), indent=2, sort_keys=True) + "\n"
