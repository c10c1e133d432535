"""A generated corpus of malformed and hostile raw-HTTP requests (issue 15), and what each must get.

``corpus(key)`` returns at least 600 ``Case``s, deterministic (no randomness): HTTP-level damage
(methods, request lines, headers, Content-Length, auth, Content-Type), JSON-level damage (invalid
JSON, deep nesting, lone surrogates, NaN, integers beyond 64 bits, oversize bodies) and field-level
mutations of every endpoint's main fields. ``check(case, resp, secrets)`` says what is wrong with
an answer: the status class, an OpenAI-shaped JSON body (Anthropic's envelope on /v1/messages), no
secret or server path echoed, an answer within the bound.

HAProxy 2.8's HTTP/1 parser answers some malformed requests itself, before any rule or errorfile of
the frontend applies, with its built-in HTML page: the H1 mux's ``h1_send_error`` writes HAProxy's
compiled-in message and honours an ``errorfile`` only to send nothing (upstream issue class
haproxy/haproxy#3032). Those cases (``HAPROXY_BUILTIN``: bad request lines, NUL/CR/control bytes in
headers, headers over ``tune.bufsize``, bad Content-Length/Transfer-Encoding, a fragment in the
target) carry ``haproxy_builtin=True``: their status class is still checked, not their body.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from tests.integration.rawhttp import RawResponse, request

ANSWER_BOUND_S = 30.0  # every case is answered within this (a 2-token generation included)
MAX_BODY_BYTES = 256 * 1024  # tests/integration/conftest.py's gateway.http.max_body_bytes

CHAT = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": "tiny-chat", "prompt": "hi", "max_tokens": 2}
EMBED = {"model": "minilm-embed", "input": "hi"}
RESPONSES = {"model": "tiny-chat", "input": "hi", "max_output_tokens": 2, "store": False}
MESSAGES = {"model": "tiny-chat", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
TOKENIZE = {"model": "tiny-chat", "prompt": "hi"}

BASES = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": COMPLETION,
    "/v1/embeddings": EMBED,
    "/v1/responses": RESPONSES,
    "/v1/messages": MESSAGES,
    "/tokenize": TOKENIZE,
}

# Strings that must never appear in an answer: server paths, tracebacks.
LEAKS = ("Traceback", "/work/", "/tmp/", "site-packages", "/home/", "/root/", 'File "')
FAKE_SECRET = "sk-sa-fuzz-secret-do-not-echo-0123456789abcdef"


@dataclass(frozen=True)
class Case:
    """One raw request and the status classes (2, 4, 5) it may get."""

    name: str
    data: bytes
    expect: frozenset[int] = frozenset({4})
    haproxy_builtin: bool = False  # answered by HAProxy's parser with its HTML page (see above)
    anthropic: bool = False  # errors in Anthropic's envelope


# Requests HAProxy's HTTP/1 parser refuses itself with its built-in HTML page (see the docstring),
# by the name they have in the corpus (their prefix stripped).
HAPROXY_BUILTIN = frozenset({
    "nul_in_value", "cr_in_value", "no_colon", "space_before_colon", "empty_name", "ctl_in_name",
    "header_17k", "header_64k", "headers_200", "cl_letters", "cl_negative", "cl_two_values",
    "cl_twice_differ", "cl_plus", "cl_hex", "cl_huge", "te_bad_chunk", "te_unknown", "te_chunked_twice",
    "host_twice", "no_version", "garbage", "nul_path", "space_in_path", "extra_token", "http0.9",
    "lowercase_version", "empty_method", "utf8_method", "ctl_in_path", "binary_tls_hello",
    "/v1/models#frag",
})


class Raw(str):
    """A JSON text inserted as it is (for what json.dumps cannot write: NaN, huge ints, ...)."""


def _dumps(obj: Any) -> str:
    """json.dumps, except that ``Raw`` values are inserted verbatim."""
    if isinstance(obj, Raw):
        return str(obj)
    if isinstance(obj, dict):
        return "{" + ",".join(f"{json.dumps(k)}:{_dumps(v)}" for k, v in obj.items()) + "}"
    if isinstance(obj, list):
        return "[" + ",".join(_dumps(v) for v in obj) + "]"
    return json.dumps(obj)


def deep_list(depth: int, leaf: str = "1") -> Raw:
    return Raw("[" * depth + leaf + "]" * depth)


def deep_obj(depth: int) -> Raw:
    return Raw('{"a":' * depth + "1" + "}" * depth)


SURROGATES = (Raw('"\\ud800"'), Raw('"\\udfff"'), Raw('"a\\udc00b"'), Raw('"\\udc00\\ud800"'))
BIG_INTS = (Raw(str(2**63)), Raw(str(2**64)), Raw(str(2**70)), Raw(str(-(2**70))), Raw("1" + "0" * 400))
NONFINITE = (Raw("NaN"), Raw("Infinity"), Raw("-Infinity"), Raw("1e999"))

# Values every mutated field gets (each then expects 2xx or 4xx, never 5xx).
VALUES: tuple[tuple[str, Any], ...] = (
    ("null", None), ("str", "x"), ("neg", -1), ("zero", 0), ("i32", 2**31), ("u32", 2**32 + 1),
    ("float", 1.5), ("huge_float", 1e308), ("true", True), ("list1", [1]), ("obj1", {"a": 1}),
    ("surrogate", SURROGATES[0]), ("i63", BIG_INTS[0]), ("i70", BIG_INTS[2]), ("nan", NONFINITE[0]),
    ("deep", deep_list(100)),
)

FIELDS = {
    "/v1/chat/completions": (
        "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
        "min_p", "n", "stop", "seed", "stream", "stream_options", "logprobs", "top_logprobs",
        "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
        "response_format", "structured_outputs", "tools", "tool_choice", "user", "min_tokens",
        "prompt_logprobs", "chat_template_kwargs", "priority", "truncate_prompt_tokens",
        "parallel_tool_calls", "ignore_eos", "stop_token_ids", "bad_words",
    ),
    "/v1/completions": ("prompt", "max_tokens", "echo", "logprobs", "n", "suffix", "top_k", "seed"),
    "/v1/embeddings": ("input", "encoding_format", "dimensions", "truncate_prompt_tokens"),
    "/v1/responses": ("input", "max_output_tokens", "temperature", "text"),
    "/v1/messages": ("messages", "max_tokens", "system", "stop_sequences"),
    "/tokenize": ("prompt", "add_special_tokens"),
}


def _post(path: str, body: bytes, key: str, *, ctype: str = "application/json",
          extra: list[tuple[str, str]] | None = None) -> bytes:
    headers = [("Authorization", f"Bearer {key}"), ("Content-Type", ctype), *(extra or [])]
    return request("POST", path, headers=headers, body=body)


def _json_cases(key: str) -> Iterator[Case]:
    """Damaged JSON, on each endpoint."""
    invalid = {
        "empty": b"", "open": b"{", "close": b"}", "array": b"[]", "null": b"null", "number": b"1",
        "string": b'"s"', "missing_value": b'{"a":}', "trailing_comma": b'{"model":"tiny-chat",}',
        "single_quotes": b"{'model':'tiny-chat'}", "comment": b'{"model":"tiny-chat"/*c*/}',
        "bom": b"\xef\xbb\xbf" + json.dumps(CHAT).encode(), "latin1": b'{"model":"\xff"}',
        "utf16": json.dumps(CHAT).encode("utf-16"), "garbage_after": json.dumps(CHAT).encode() + b"xx",
        "two_docs": json.dumps(CHAT).encode() * 2, "nul": b'{"model":"tiny\x00"}',
        "ctrl_in_string": b'{"model":"a\x01b"}', "bad_escape": b'{"model":"\\x41"}',
        "short_unicode": b'{"model":"\\u12"}', "unterminated": b'{"model":"tiny',
        "deep_array_65": deep_list(65).encode(), "deep_array_1000": deep_list(1000).encode(),
        "deep_object_1000": deep_obj(1000).encode(), "deep_array_20000": deep_list(20000).encode(),
    }
    for path in BASES:
        anth = path == "/v1/messages"
        for name, body in invalid.items():
            yield Case(f"json:{path}:{name}", _post(path, body, key), anthropic=anth)
    for path, base in BASES.items():
        anth = path == "/v1/messages"
        main = "messages" if "messages" in base else ("input" if "input" in base else "prompt")
        hostile = {
            "deep_in_main_65": deep_list(65), "deep_in_main_300": deep_list(300),
            "deep_obj_in_main_300": deep_obj(300), "nan_in_main": NONFINITE[0],
            **{f"surrogate{i}_in_main": s for i, s in enumerate(SURROGATES)},
        }
        for name, value in hostile.items():
            yield Case(f"json:{path}:{name}", _post(path, _dumps({**base, main: value}).encode(), key),
                       anthropic=anth)
        for i, s in enumerate(SURROGATES):
            yield Case(f"json:{path}:surrogate{i}_in_model",
                       _post(path, _dumps({**base, "model": s}).encode(), key), anthropic=anth)
            as_key = _dumps(base)[:-1] + "," + str(s) + ":1}"
            yield Case(f"json:{path}:surrogate{i}_as_key", _post(path, as_key.encode(), key),
                       anthropic=anth)
        for i, n in enumerate(BIG_INTS):
            yield Case(f"json:{path}:bigint{i}_extra_field",
                       _post(path, _dumps({**base, "seed": n}).encode(), key), anthropic=anth)
        for i, n in enumerate(NONFINITE):
            yield Case(f"json:{path}:nonfinite{i}_temperature",
                       _post(path, _dumps({**base, "temperature": n}).encode(), key), anthropic=anth)
        yield Case(f"json:{path}:duplicate_model",
                   _post(path, json.dumps(base).encode()[:-1] + b',"model":"gpt-17"}', key),
                   anthropic=anth)
        yield Case(f"json:{path}:over_body_limit",
                   _post(path, _dumps({**base, "user": "x" * (MAX_BODY_BYTES + 10)}).encode(), key),
                   anthropic=anth)
        for ctype in ("", "text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                      "application/json; charset=latin-1", "application/jsonx", "application/json\t"):
            yield Case(f"ctype:{path}:{ctype or 'none'}", _post(path, json.dumps(base).encode(), key,
                                                                 ctype=ctype),
                       expect=frozenset({2, 4}), anthropic=anth)


def _field_cases(keys: tuple[str, ...]) -> Iterator[Case]:
    """Each main field of each endpoint, set to each hostile value (spread over ``keys``, so that
    no key's requests-per-minute limit answers 429 in place of the case's real answer)."""
    n = 0
    for path, fields in FIELDS.items():
        base = BASES[path]
        anth = path == "/v1/messages"
        for field_name in fields:
            for vname, value in VALUES:
                body = {**base, field_name: value}
                if field_name == "stream" and value is True:
                    continue  # a valid stream: covered by the parity tests
                key = keys[n % len(keys)]
                n += 1
                yield Case(f"field:{path}:{field_name}={vname}", _post(path, _dumps(body).encode(), key),
                           expect=frozenset({2, 4}), anthropic=anth)


def _http_cases(key: str) -> Iterator[Case]:
    """Damage at the HTTP level: methods, request lines, headers, framing, auth."""
    auth = [("Authorization", f"Bearer {key}")]
    body = json.dumps(CHAT).encode()
    for method in ("FOO", "TRACE", "PROPFIND", "PUT", "DELETE", "PATCH", "OPTIONS", "get", "M-SEARCH"):
        for path in ("/v1/chat/completions", "/v1/models", "/health", "/"):
            yield Case(f"method:{method}:{path}", request(method, path, headers=auth))
    yield Case("method:CONNECT", b"CONNECT 127.0.0.1:443 HTTP/1.1\r\nHost: 127.0.0.1:443\r\n\r\n")
    yield Case("method:OPTIONS*", b"OPTIONS * HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    yield Case("method:GET_body", request("GET", "/v1/models", headers=auth, body=b"{}"),
               expect=frozenset({2, 4}))
    paths = (
        "/nope", "/v1/nope", "/v2/chat/completions", "/v1/chat/completions/", "/../../etc/passwd",
        "/v1/../../etc/passwd", "/%2e%2e/%2e%2e/etc/passwd", "/v1/models/..%2f..%2fetc%2fpasswd",
        "/v1/models/%00", "/v1/models/%ff%fe", "/v1/models/" + "a" * 4000, "/" + "x" * 7000,
        "/v1/models?" + "a=1&" * 1000, "/v1/chat/completions?api_key=" + FAKE_SECRET,
        "/v1/models/%F0%9F%92%A9", "//v1//models", "/v1/models#frag", "/.env", "/.git/config",
        "/-/routes/../", "/v1/models/../../../../proc/self/environ", "/v1/models/a%0d%0aX-Injected:%201",
    )
    # 3xx: FastAPI redirects a trailing slash.
    for p in paths:
        yield Case(f"path:{p[:60]}", request("GET", p, headers=auth), expect=frozenset({2, 3, 4}),
                   haproxy_builtin=p in HAPROXY_BUILTIN)
        yield Case(f"path_post:{p[:60]}", request("POST", p, headers=[*auth, ("Content-Type", "application/json")],
                                                  body=body), expect=frozenset({2, 3, 4}),
                   haproxy_builtin=p in HAPROXY_BUILTIN)
    # Request lines HAProxy's parser refuses with its own page before any rule applies.
    bad_lines = {
        "no_version": b"GET /\r\n\r\n", "bad_version": b"GET / HTTP/9.9\r\nHost: x\r\n\r\n",
        "garbage": b"\x00\x01\x02\x03\r\n\r\n", "nul_path": b"GET /v1/mo\x00dels HTTP/1.1\r\nHost: x\r\n\r\n",
        "space_in_path": b"GET /v1/mo dels HTTP/1.1\r\nHost: x\r\n\r\n",
        "extra_token": b"GET / HTTP/1.1 extra\r\nHost: x\r\n\r\n", "lf_only": b"GET / HTTP/1.1\nHost: x\n\n",
        "tab_line": b"GET\t/\tHTTP/1.1\r\nHost: x\r\n\r\n", "http0.9": b"GET /\r\n",
        "lowercase_version": b"GET / http/1.1\r\nHost: x\r\n\r\n", "empty_method": b" / HTTP/1.1\r\nHost: x\r\n\r\n",
        "utf8_method": "GÉT / HTTP/1.1\r\nHost: x\r\n\r\n".encode(), "ctl_in_path": b"GET /\x7f HTTP/1.1\r\nHost: x\r\n\r\n",
        "binary_tls_hello": bytes.fromhex("16030100a5010000a10303") + b"\x00" * 40,
    }
    lenient = {"bad_version", "lf_only", "tab_line"}  # HAProxy reads these as HTTP/1.x
    for name, data in bad_lines.items():
        yield Case(f"line:{name}", data, expect=frozenset({2, 4}) if name in lenient else frozenset({4}),
                   haproxy_builtin=name in HAPROXY_BUILTIN)
    bad_headers: dict[str, bytes] = {
        "nul_in_value": request("GET", "/v1/models", headers=[*auth, ("X-A", "a\x00b")]),
        "cr_in_value": request("GET", "/v1/models", headers=[*auth, ("X-A", "a\rb")]),
        "no_colon": request("GET", "/v1/models", headers=auth)[:-2] + b"NoColonHere\r\n\r\n",
        "space_before_colon": request("GET", "/v1/models", headers=[*auth, ("X-A ", "1")]),
        "obs_fold": request("GET", "/v1/models", headers=auth)[:-2] + b"X-A: 1\r\n folded\r\n\r\n",
        "empty_name": request("GET", "/v1/models", headers=auth)[:-2] + b": v\r\n\r\n",
        "ctl_in_name": request("GET", "/v1/models", headers=[*auth, ("X\x01A", "1")]),
        "header_17k": request("GET", "/v1/models", headers=[*auth, ("X-Big", "a" * 17000)]),
        "header_64k": request("GET", "/v1/models", headers=[*auth, ("X-Big", "a" * 65000)]),
        "headers_200": request("GET", "/v1/models", headers=[*auth, *[(f"X-{i}", "v" * 90) for i in range(200)]]),
        "cl_letters": _post("/v1/chat/completions", body, key, extra=[("Content-Length", "abc")]),
        "cl_negative": _post("/v1/chat/completions", body, key, extra=[("Content-Length", "-1")]),
        "cl_two_values": _post("/v1/chat/completions", body, key,
                               extra=[("Content-Length", f"{len(body)}, {len(body) + 1}")]),
        "cl_twice_differ": _post("/v1/chat/completions", body, key,
                                 extra=[("Content-Length", str(len(body))), ("Content-Length", "3")]),
        "cl_plus": _post("/v1/chat/completions", body, key, extra=[("Content-Length", f"+{len(body)}")]),
        "cl_hex": _post("/v1/chat/completions", body, key, extra=[("Content-Length", hex(len(body)))]),
        "cl_huge": _post("/v1/chat/completions", body, key, extra=[("Content-Length", "9" * 30)]),
        "te_bad_chunk": _post("/v1/chat/completions", b"zz\r\n" + body + b"\r\n0\r\n\r\n", key,
                              extra=[("Transfer-Encoding", "chunked")]),
        "te_unknown": _post("/v1/chat/completions", body, key, extra=[("Transfer-Encoding", "gzip")]),
        "te_and_cl": _post("/v1/chat/completions", f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n", key,
                           extra=[("Transfer-Encoding", "chunked"), ("Content-Length", "5")]),
        "te_chunked_twice": _post("/v1/chat/completions", body, key,
                                  extra=[("Transfer-Encoding", "chunked, chunked")]),
        "host_twice": request("GET", "/v1/models", headers=[*auth, ("Host", "a"), ("Host", "b")]),
        "no_host_1.1": b"GET /v1/models HTTP/1.1\r\nAuthorization: Bearer " + key.encode() + b"\r\n\r\n",
    }
    for name, data in bad_headers.items():
        yield Case(f"header:{name}", data, expect=frozenset({2, 4}), haproxy_builtin=name in HAPROXY_BUILTIN)
    # Good-looking requests with bad credentials: 401, and the secret is never echoed.
    creds = {
        "none": [], "bearer_empty": [("Authorization", "Bearer")], "bearer_space": [("Authorization", "Bearer ")],
        "basic": [("Authorization", "Basic dXNlcjpwYXNz")], "fake": [("Authorization", f"Bearer {FAKE_SECRET}")],
        "fake_xapi": [("x-api-key", FAKE_SECRET)], "fake_long": [("Authorization", "Bearer " + FAKE_SECRET * 150)],
        "fake_unicode": [("Authorization", "Bearer sk-\u00e9\u00e8")], "two_auth": [
            ("Authorization", f"Bearer {FAKE_SECRET}"), ("Authorization", f"Bearer {key}")],
        "key_in_query": [], "lowercase_bearer": [("Authorization", f"bearer {FAKE_SECRET}")],
    }
    for name, headers in creds.items():
        for path in ("/v1/chat/completions", "/v1/models", "/v1/messages", "/v1/usage"):
            data = (request("POST", path, headers=[*headers, ("Content-Type", "application/json")], body=body)
                    if path != "/v1/models" and path != "/v1/usage" else request("GET", path, headers=headers))
            yield Case(f"auth:{name}:{path}", data, expect=frozenset({2, 4}),
                       anthropic=path == "/v1/messages")


def _multipart(parts: list[tuple[str, str | None, bytes]], boundary: str = "fuzzb") -> bytes:
    """A multipart/form-data body of (field, filename, bytes) parts."""
    out = b""
    for name, filename, data in parts:
        disp = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        out += f"--{boundary}\r\nContent-Disposition: {disp}\r\n\r\n".encode() + data + b"\r\n"
    return out + f"--{boundary}--\r\n".encode()


def _batch_cases(key: str) -> Iterator[Case]:
    """The Batch API's routes (/v1/files, /v1/batches): damaged uploads, ids, queries, bodies."""
    form = "multipart/form-data; boundary=fuzzb"
    good = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'
    uploads = {
        "no_file": (_multipart([("purpose", None, b"batch")]), form),
        "no_purpose": (_multipart([("file", "a.jsonl", good)]), form),
        "purpose_fine_tune": (_multipart([("purpose", None, b"fine-tune"), ("file", "a", good)]), form),
        "purpose_surrogate": (_multipart([("purpose", None, b"\xed\xa0\x80"), ("file", "a", good)]),
                              form),
        "empty_file": (_multipart([("purpose", None, b"batch"), ("file", "a.jsonl", b"")]), form),
        "latin1_file": (_multipart([("purpose", None, b"batch"), ("file", "a", b"\xff\xfe")]), form),
        "two_files": (_multipart([("purpose", None, b"batch"), ("file", "a", good),
                                  ("file", "b", good)]), form),
        "file_as_field": (_multipart([("purpose", None, b"batch"), ("file", None, good)]), form),
        "broken_boundary": (b"--fuzzb\r\nbroken", form),
        "no_boundary": (_multipart([("purpose", None, b"batch")]), "multipart/form-data"),
        "json_ctype": (b'{"purpose": "batch"}', "application/json"),
        "no_ctype": (b"x", ""),
    }
    for name, (body, ctype) in uploads.items():
        yield Case(f"batch:upload:{name}", _post("/v1/files", body, key, ctype=ctype))
    auth = [("Authorization", f"Bearer {key}")]
    ids = ("file-nope", "..%2F..%2Fetc%2Fpasswd", "%00", "x" * 300, "%F0%9F%98%80", "file-%2e%2e")
    for i, fid in enumerate(ids):
        yield Case(f"batch:get_file{i}", request("GET", f"/v1/files/{fid}", headers=auth))
        yield Case(f"batch:content{i}", request("GET", f"/v1/files/{fid}/content", headers=auth))
        yield Case(f"batch:delete{i}", request("DELETE", f"/v1/files/{fid}", headers=auth))
        yield Case(f"batch:get_batch{i}", request("GET", f"/v1/batches/{fid}", headers=auth))
        yield Case(f"batch:cancel{i}", request("POST", f"/v1/batches/{fid}/cancel", headers=auth))
    for i, query in enumerate(("limit=0", "limit=-1", "limit=abc", "limit=99999999999999999999",
                               "order=sideways", "purpose=fine-tune", "after=" + "x" * 200)):
        yield Case(f"batch:list_files{i}", request("GET", f"/v1/files?{query}", headers=auth))
    for i, query in enumerate(("limit=0", "limit=101", "limit=abc", "after=" + "x" * 200)):
        yield Case(f"batch:list_batches{i}", request("GET", f"/v1/batches?{query}", headers=auth))
    create = {"input_file_id": "file-nope", "endpoint": "/v1/chat/completions",
              "completion_window": "24h"}
    mutations: dict[str, Any] = {
        "input_file_id": (None, 1, [], "", "x" * 5000, "../../etc/passwd"),
        "endpoint": (None, "/v1/completions", "/v1/chat/completions/", 7, ["x"]),
        "completion_window": (None, "1h", "24H", 24, "24h" * 100),
        "metadata": ("x", [1], {"a": 1}, {f"k{i}": "v" for i in range(20)}, {"k": "v" * 600}),
    }
    for field_name, values in mutations.items():
        for j, value in enumerate(values):
            yield Case(f"batch:create:{field_name}{j}",
                       _post("/v1/batches", _dumps({**create, field_name: value}).encode(), key))
    for name, raw in (("empty", b""), ("array", b"[]"), ("open", b"{"), ("nan", b'{"x": NaN}'),
                      ("deep", deep_list(10_000).encode())):
        yield Case(f"batch:create_json:{name}", _post("/v1/batches", raw, key))


ADMIN_BODIES: dict[str, bytes] = {
    "empty": b"", "null": b"null", "array": b"[]", "open": b"{", "deep": deep_obj(1000).encode(),
    "id_missing": b'{"tier":"standard"}', "id_null": b'{"id":null}', "id_number": b'{"id":7}',
    "id_long": json.dumps({"id": "a" * 65}).encode(), "id_traversal": b'{"id":"../../etc/passwd"}',
    "id_unicode": json.dumps({"id": "\u00e9t\u00e9"}).encode(), "id_nul": rb'{"id":"a\u0000"}',
    "id_surrogate": rb'{"id":"\ud800"}', "role_root": b'{"id":"fz1","role":"root"}',
    "tier_unknown": b'{"id":"fz2","tier":"gold"}', "tier_list": b'{"id":"fz3","tier":["x"]}',
    "budget_negative": b'{"id":"fz4","budget":{"tokens":-1}}',
    "budget_huge": b'{"id":"fz5","budget":{"tokens":1e400}}',
    "budget_period": b'{"id":"fz6","budget":{"tokens":5,"period":"year"}}',
    "expiry_text": b'{"id":"fz7","expires_at":"tomorrow"}',
    "limits_text": b'{"id":"fz8","limits":{"rpm":"many"}}',
    "digest_given": b'{"id":"fz9","digest":"sha256:00"}',
    "secret_given": json.dumps({"id": "fz10", "secret": FAKE_SECRET}).encode(),
    "bigint": b'{"id":"fz11","budget":{"tokens":123456789012345678901234567890}}',
}
ADMIN_PATHS = ("/admin/v1/keys/nobody", "/admin/v1/keys/..%2f..%2fetc", "/admin/v1/keys/%00",
               "/admin/v1/keys/" + "k" * 5000, "/admin/v1/keys/a/b/c", "/admin/v1/usage?period=x",
               "/admin/v1/usage?key_id=" + "k" * 200, "/admin/v1/usage?model=%ff%fe",
               "/admin/v1/nothing", "/admin/v1/openapi.json")


def admin_cases(key: str) -> Iterator[Case]:
    """The admin API's routes with hostile bodies, ids and queries, as ``key`` (an admin key: the
    parsers are reached; a client key: 403 first). No create here succeeds."""
    auth = [("Authorization", f"Bearer {key}")]
    for name, body in ADMIN_BODIES.items():
        yield Case(f"admin:create:{name}", _post("/admin/v1/keys", body, key))
        patch = request("PATCH", "/admin/v1/keys/nobody",
                        headers=[*auth, ("Content-Type", "application/json")], body=body)
        yield Case(f"admin:update:{name}", patch)
    for path in ADMIN_PATHS:
        for method in ("GET", "PATCH", "DELETE", "POST"):
            yield Case(f"admin:{method}:{path[:60]}", request(method, path, headers=auth),
                       expect=frozenset({2, 4}))
    yield Case("admin:rotate:nobody", request("POST", "/admin/v1/keys/nobody/rotate", headers=auth))
    yield Case("admin:no_key", request("GET", "/admin/v1/keys"))
    # Issue 36: the key before the body. With no key, a hostile body is never parsed (401, not
    # 400), and a body that is declared 40 MB but never sent is not waited for.
    for name, body in ADMIN_BODIES.items():
        yield Case(f"admin:no_key:create:{name}",
                   request("POST", "/admin/v1/keys", headers=[("Content-Type", "application/json")],
                           body=body))
    for method, path in (("POST", "/admin/v1/keys"), ("PATCH", "/admin/v1/keys/nobody")):
        yield Case(f"admin:no_key:{method}:declared_40mb",
                   request(method, path, headers=[("Content-Type", "application/json"),
                                                  ("Content-Length", str(40 * 1024 * 1024))],
                           body=b"{", content_length=False))
    yield Case("admin:fake_key", request("GET", "/admin/v1/keys",
                                         headers=[("Authorization", f"Bearer {FAKE_SECRET}")]))


def corpus(key: str, *more_keys: str) -> list[Case]:
    """Every case, with ``key`` (and ``more_keys``, for the field mutations) as valid API keys."""
    cases = [*_http_cases(key), *_json_cases(key), *_field_cases((key, *more_keys)),
             *_batch_cases(key),
             *admin_cases(key)]
    names = [c.name for c in cases]
    dup = {n for n in names if names.count(n) > 1}
    assert not dup, f"duplicate case names: {sorted(dup)[:5]}"
    return cases


def _openai_shaped(body: Any) -> bool:
    if not (isinstance(body, dict) and set(body) == {"error"} and isinstance(body["error"], dict)):
        return False
    err = body["error"]
    return set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str)


def _anthropic_shaped(body: Any) -> bool:
    return (isinstance(body, dict) and body.get("type") == "error" and isinstance(body.get("error"), dict)
            and isinstance(body["error"].get("message"), str))


def check(case: Case, resp: RawResponse, secrets: tuple[str, ...]) -> list[str]:
    """What is wrong with ``resp`` as the answer to ``case`` (empty if nothing)."""
    problems: list[str] = []
    if resp.status == 0:
        return [f"no answer in {resp.elapsed_s:.1f} s ({'timed out' if resp.timed_out else 'closed'})"]
    if resp.elapsed_s > ANSWER_BOUND_S:
        problems.append(f"answered after {resp.elapsed_s:.1f} s")
    if resp.status // 100 not in case.expect:
        problems.append(f"status {resp.status} not in {sorted(case.expect)}xx")
    text = resp.raw.decode("utf-8", "replace")
    for s in (*secrets, FAKE_SECRET, *LEAKS):
        if s in text:
            problems.append(f"echoed {s[:12]!r}")
    if case.haproxy_builtin and resp.status >= 400:
        return problems
    ctype = resp.headers.get("content-type", "")
    if resp.status >= 400 or "json" in ctype:
        try:
            body = json.loads(resp.body)
        except ValueError:
            problems.append(f"body not JSON ({ctype or 'no content-type'}): {resp.body[:80]!r}")
            return problems
        if resp.status >= 400:
            ok = _anthropic_shaped(body) if case.anthropic else _openai_shaped(body)
            if case.anthropic and not ok:
                ok = _openai_shaped(body)  # errors before routing (HAProxy, 404) are OpenAI's
            if not ok:
                problems.append(f"error body not OpenAI-shaped: {resp.body[:120]!r}")
    elif resp.status < 300 and "event-stream" not in ctype and resp.body:
        problems.append(f"2xx with content-type {ctype!r}")
    return problems
