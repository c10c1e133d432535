"""The hostile-input corpus generator (tests/integration/fuzz_corpus.py) and its answer checks."""

from __future__ import annotations

import json

from tests.integration.fuzz_corpus import FAKE_SECRET, HAPROXY_BUILTIN, Case, check, corpus
from tests.integration.rawhttp import RawResponse, _parse, request


def _resp(status: int, body: bytes, ctype: str = "application/json") -> RawResponse:
    raw = f"HTTP/1.1 {status} X\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
    return RawResponse(status, {"content-type": ctype}, body, 0.01, raw + body)


def test_corpus_is_large_deterministic_and_uses_the_keys() -> None:
    cases = corpus("sk-a", "sk-b")
    assert len(cases) >= 600
    assert [c.data for c in cases] == [c.data for c in corpus("sk-a", "sk-b")]
    assert all(c.expect <= {2, 3, 4} for c in cases)  # never a 5xx
    assert sum(b"sk-b" in c.data for c in cases) > 100
    builtin = {c.name.split(":", 1)[1] for c in cases if c.haproxy_builtin}
    assert builtin == set(HAPROXY_BUILTIN)
    assert sum(c.haproxy_builtin for c in cases) == len(HAPROXY_BUILTIN) + 1  # the path, GET and POST


def test_check_names_each_kind_of_wrong_answer() -> None:
    case = Case("x", b"")
    good = json.dumps({"error": {"message": "m", "type": "t", "param": None, "code": "c"}}).encode()
    assert check(case, _resp(400, good), ("sk-a",)) == []
    assert "status 500" in check(case, _resp(500, good), ())[0]
    assert "not JSON" in check(case, _resp(400, b"<html>", "text/html"), ())[0]
    assert "OpenAI-shaped" in check(case, _resp(400, b'{"detail": "x"}'), ())[0]
    echoed = good.replace(b'"m"', json.dumps(FAKE_SECRET + " /work/x.py").encode())
    assert len(check(case, _resp(400, echoed), ())) == 2
    assert "no answer" in check(case, RawResponse(0, elapsed_s=31, timed_out=True), ())[0]
    builtin = Case("y", b"", haproxy_builtin=True)
    assert check(builtin, _resp(400, b"<html>", "text/html"), ()) == []


def test_raw_client_reads_chunked_and_sized_answers() -> None:
    got, done = _parse(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n")
    assert done and got is not None and got.body == b"abc"
    got, done = _parse(b"HTTP/1.1 400 X\r\nContent-Length: 5\r\n\r\nab")
    assert not done
    data = request("POST", "/v1/x", headers={"A": "1"}, body=b"{}")
    assert data.endswith(b"\r\n\r\n{}") and b"Content-Length: 2\r\n" in data
