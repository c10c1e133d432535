"""SLA verdicts per tier: p95 TTFT and TPOT measured by a load test against the tier's objectives.

Shared by the locust file (verdict lines, the web UI's SLA tab) and the sweep. Objectives come from
the app config (``tiers.<name>.objectives``), the same numbers the gateway and the dashboards use.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from serve_app.config import load_app_config

DEFAULT_APP_CONFIG = "configs/local.yaml"
# Locust request types of the per-tier latency entries (their name is the tier).
TTFT, TPOT, E2E = "TTFT", "TPOT", "E2E"


@dataclass(frozen=True)
class Objective:
    ttft_p95_ms: float
    tpot_p95_ms: float
    priority: int = 0  # vLLM priority of the tier: lower runs first


@dataclass(frozen=True)
class TierResult:
    """One tier's measured p95s, with its objectives and the verdict."""

    tier: str
    requests: int
    errors: int
    ttft_p50_ms: float | None
    ttft_p95_ms: float | None
    tpot_p95_ms: float | None
    e2e_p95_ms: float | None
    ttft_objective_ms: float
    tpot_objective_ms: float
    max_error_rate: float = 0.05  # a larger share of failed requests fails the tier too

    @property
    def status(self) -> str:
        if not self.requests or self.ttft_p95_ms is None or self.tpot_p95_ms is None:
            return "NO DATA"
        ok = (self.ttft_p95_ms <= self.ttft_objective_ms and self.tpot_p95_ms <= self.tpot_objective_ms
              and self.errors <= self.max_error_rate * self.requests)
        return "PASS" if ok else "FAIL"

    @property
    def passed(self) -> bool:
        return self.status == "PASS"

    def line(self) -> str:
        """``SLA premium: PASS ttft_p95=812ms<=1000ms tpot_p95=40ms<=150ms (n=120, errors=0)``."""
        def part(name: str, value: float | None, objective: float) -> str:
            if value is None:
                return f"{name}=n/a (objective {objective:.0f}ms)"
            op = "<=" if value <= objective else ">"
            return f"{name}={value:.0f}ms{op}{objective:.0f}ms"

        return (f"SLA {self.tier}: {self.status} "
                f"{part('ttft_p95', self.ttft_p95_ms, self.ttft_objective_ms)} "
                f"{part('tpot_p95', self.tpot_p95_ms, self.tpot_objective_ms)} "
                f"(n={self.requests}, errors={self.errors})")

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "status": self.status}


def read_objectives(app_config: str | Path = DEFAULT_APP_CONFIG) -> dict[str, Objective]:
    """Each tier's objectives, in the config's order (the first tier is the top tier)."""
    cfg = load_app_config(app_config)
    return {
        name: Objective(t.objectives.ttft_p95_ms, t.objectives.tpot_p95_ms, t.priority)
        for name, t in cfg.tiers.items()
    }


def top_tier(objectives: dict[str, Objective]) -> str:
    """The tier that runs first (lowest priority, then tightest TTFT objective): premium here."""
    return min(objectives, key=lambda n: (objectives[n].priority, objectives[n].ttft_p95_ms, n))
