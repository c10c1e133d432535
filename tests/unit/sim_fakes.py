"""Shared pieces of the simulated engine's unit tests: a fake clock and a step recorder."""

from __future__ import annotations

import asyncio

from serve_app.engine.sim.engine import StepReport


class FakeClock:
    """Modelled time that passes only when the engine sleeps (no wall-clock wait)."""

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    async def sleep(self, modelled_s: float) -> None:
        self.t += modelled_s
        await asyncio.sleep(0)

    def idle(self) -> None:
        return None


class Steps:
    """Keeps every ``StepReport`` the engine sends."""

    def __init__(self) -> None:
        self.reports: list[StepReport] = []

    def step(self, report: StepReport) -> None:
        self.reports.append(report)
