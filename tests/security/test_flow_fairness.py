"""The flow queue's new-flow rule cannot be replayed to starve another tenant (issue 36).

A tenant with nothing waiting that sends a request gets the next turn (FQ-CoDel's new flows).
Before, a tenant that sent its next request as soon as its last was served was "new" every
time: it took every turn, and a busy tenant in the same band got nothing while it kept at it."""

from __future__ import annotations

from collections import Counter

from tests.unit.test_flow import _cfg, _flow, _reserve, run


def test_a_tenant_that_resends_at_once_does_not_take_every_turn() -> None:
    cfg = _cfg(inflight=1)

    async def go() -> Counter[str]:
        flow = _flow(cfg)
        _reserve(flow, cfg, "standard", "x")  # holds the one slot
        busy = [_reserve(flow, cfg, "standard", "busy") for _ in range(200)]
        eager = _reserve(flow, cfg, "standard", "eager")
        served: Counter[str] = Counter()
        waiters = [*busy, eager]
        counted: list[bool] = [False] * len(waiters)
        for _ in range(100):  # one slot freed at a time
            flow.release("tiny")
            for i, w in enumerate(waiters):
                if w.granted and not counted[i]:
                    counted[i] = True
                    served[w.tenant] += 1
            if eager.granted:  # the replay: its next request right after it is served
                eager = _reserve(flow, cfg, "standard", "eager")
                waiters.append(eager)
                counted.append(False)
        return served

    served = run(go)
    assert served["eager"] + served["busy"] == 100
    assert served["busy"] >= 40, served  # about half each (equal costs); before: 0
