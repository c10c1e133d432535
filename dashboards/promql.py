"""A tiny client for Prometheus's HTTP API (stdlib only), for the report and the tests."""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
from typing import Any


class PromQL:
    """A tiny client for Prometheus's HTTP API (stdlib only)."""

    def __init__(self, url: str, timeout_s: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def _get(self, path: str, params: dict[str, Any]) -> Any:
        qs = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}{path}?{qs}", timeout=self.timeout_s) as r:
            body = json.loads(r.read())
        if body.get("status") != "success":
            raise RuntimeError(f"prometheus: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant vector (``result``) for ``expr``; raises on a PromQL error."""
        params: dict[str, Any] = {"query": expr}
        if at is not None:
            params["time"] = at
        data = self._get("/api/v1/query", params)
        result = data["result"]
        return result if isinstance(result, list) else [{"value": result}]

    def query_range(self, expr: str, start: float, end: float, step_s: float) -> list[dict[str, Any]]:
        data = self._get("/api/v1/query_range",
                         {"query": expr, "start": start, "end": end, "step": f"{step_s:g}"})
        return list(data["result"])

    def series_names(self) -> list[str]:
        return list(self._get("/api/v1/label/__name__/values", {}))

    def targets(self) -> list[dict[str, Any]]:
        return list(self._get("/api/v1/targets", {})["activeTargets"])

    def rules(self) -> list[dict[str, Any]]:
        return [r for g in self._get("/api/v1/rules", {})["groups"] for r in g["rules"]]
