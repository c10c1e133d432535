"""The hostile-input corpus (tests/integration/fuzz_corpus.py), raw HTTP through the real front
door: every case gets its status class, an OpenAI-shaped JSON body, no secret or path echoed, an
answer within the bound; afterwards the stack is healthy, the engines hold no request and the
gateway's memory grew by less than a set bound."""

from __future__ import annotations

import collections
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from loadtests.harness.stack import cmdline, descendants
from tests.integration.fuzz_corpus import Case, check, corpus
from tests.integration.rawhttp import RawResponse, send

pytestmark = pytest.mark.integration

RSS_GROWTH_BOUND = 64 * 2**20  # the gateway replicas' RSS, summed, after the corpus vs before
WORKERS = 8


def gateway_rss(stack) -> int:
    """The summed RSS of the stack's gateway replica processes."""
    total = 0
    for pid in descendants(stack.proc.pid):
        if any("ServeReplica:llm:gateway" in a for a in cmdline(pid)):
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
            except OSError:
                pass
    return total


def unfinished(serve_handles) -> dict[str, int]:
    return {m: serve_handles(f"model-{m}").stats.remote().result(timeout_s=30)["unfinished_requests"]
            for m in ("tiny-chat", "minilm-embed")}


def test_corpus_answers_every_case_in_the_openai_shape(stack, serve_handles) -> None:
    url = urlsplit(stack.base_url)
    host, port = url.hostname or "127.0.0.1", url.port or 80
    keys = (stack.keys["fuzz-a"], stack.keys["fuzz-b"])
    cases = corpus(*keys)
    assert len(cases) >= 600
    unfinished(serve_handles)  # warm the handles
    rss_before = gateway_rss(stack)

    def run(case: Case) -> tuple[Case, RawResponse]:
        return case, send(host, port, case.data, timeout_s=40.0)

    t0 = time.monotonic()
    with ThreadPoolExecutor(WORKERS) as pool:
        results = list(pool.map(run, cases))
    took = time.monotonic() - t0

    # Settle: a request the engine holds after its answer was sent is a leak, but give in-flight
    # aborts a moment.
    deadline = time.monotonic() + 10
    left = unfinished(serve_handles)
    while any(left.values()) and time.monotonic() < deadline:
        time.sleep(0.5)
        left = unfinished(serve_handles)
    rss_after = gateway_rss(stack)

    failures = {}
    statuses: collections.Counter[int] = collections.Counter()
    for case, resp in results:
        statuses[resp.status] += 1
        problems = check(case, resp, keys)
        if problems:
            failures[case.name] = problems
    fivexx = sorted(c.name for c, r in results if r.status >= 500)
    builtin = sorted(c.name for c, r in results if c.haproxy_builtin and r.status >= 400
                     and not r.body.lstrip().startswith(b"{"))
    report = {
        "cases": len(cases), "seconds": round(took, 1), "statuses": dict(sorted(statuses.items())),
        "5xx": len(fivexx), "wrong": len(failures), "haproxy_builtin_html": len(builtin),
        "unfinished_after": left, "gateway_rss_mib": [round(rss_before / 2**20), round(rss_after / 2**20)],
    }
    print("\n[fuzz] " + json.dumps(report))
    out = os.environ.get("FUZZ_REPORT")
    if out:
        Path(out).write_text(json.dumps({**report, "failures": failures, "5xx_cases": fivexx,
                                         "builtin_cases": builtin}, indent=1))
    assert not failures, f"{len(failures)} cases answered wrongly, e.g.: " + json.dumps(
        dict(list(failures.items())[:15]), indent=1)
    assert left == {"tiny-chat": 0, "minilm-embed": 0}, f"engine requests leaked: {left}"
    r = httpx.get(f"{stack.root_url}/health", timeout=10)
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    assert rss_after - rss_before < RSS_GROWTH_BOUND, (rss_before, rss_after)
