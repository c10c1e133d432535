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
        seen = set()
        for _ in range(100):  # one slot freed at a time
            flow.release("tiny")
            for w in [*busy, eager]:
                if w.granted and id(w) not in seen:
                    seen.add(id(w))
                    served[w.tenant] += 1
            if eager.granted:  # the replay: its next request right after it is served
                eager = _reserve(flow, cfg, "standard", "eager")
        return served

    served = run(go)
    assert served["eager"] + served["busy"] >= 95  # (a grant at the reserve is seen a round later)
    assert served["busy"] >= 40, served  # about half each (equal costs); before: 0
