"""A canary key's secret never shows up anywhere: response headers, bodies, logs or metrics."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from tests.keys import create_key

pytestmark = pytest.mark.integration


def test_canary_secret_never_leaks(stack, serve_handles) -> None:
    import ray

    secret = create_key(stack.keys_file, "canary", "standard", ["tiny-chat"], limits={"rpm": 3})
    stack.wait_keys(accepted=[secret])  # every gateway replica has reloaded the keys file
    auth = {"Authorization": f"Bearer {secret}"}
    chat = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    seen: list[httpx.Response] = []
    with httpx.Client(base_url=stack.base_url, timeout=60) as c:
        seen.append(c.post("/chat/completions", json=chat, headers=auth))
        seen.append(c.post("/chat/completions", json={**chat, "stream": True}, headers=auth))
        seen.append(c.post("/chat/completions", json={**chat, "model": "minilm-embed"}, headers=auth))
        seen.append(c.post("/chat/completions", json={**chat, "temperature": "x"}, headers=auth))
        seen.append(c.post("/chat/completions", json=chat, headers=auth))  # over rpm 3: 429
        seen.append(c.get("/usage", headers=auth))
        # Near misses of the secret must not be echoed either.
        seen.append(c.post("/chat/completions", json=chat,
                           headers={"Authorization": f"Bearer {secret}x"}))
        seen.append(c.post("/chat/completions", json=chat, headers={"Authorization": secret}))
    assert [r.status_code for r in seen] == [200, 200, 404, 400, 429, 200, 401, 401]
    for r in seen:
        assert secret not in r.text
        assert all(secret not in v for v in r.headers.values())
    usage = seen[5].json()
    assert usage["key_id"] == "canary" and usage["requests"] >= 4
    assert usage["rejections"].get("rate_limit") == 1

    # Metrics: wait until the canary's own series is exported, then check no label holds the secret.
    node = next(n for n in ray.nodes() if n["Alive"])
    url = f"http://127.0.0.1:{node['MetricsExportPort']}/metrics"
    deadline = time.monotonic() + 60
    text = ""
    while time.monotonic() < deadline:
        text = httpx.get(url, timeout=10).text
        if 'key_id="canary"' in text and "serve_app_requests_total" in text:
            break
        time.sleep(2)
    assert 'key_id="canary"' in text, "the canary's usage never reached Prometheus metrics"
    assert secret not in text

    session = Path(ray._private.worker.global_worker.node.get_session_dir_path())
    for path in [stack.log, *(p for p in (session / "logs").rglob("*") if p.is_file())]:
        assert secret.encode() not in path.read_bytes(), f"secret found in {path}"

    # The audit trail (gateway.state.dir, which serve-app run sets): the canary's failed
    # authentications are there, its secret is not.
    audit = stack.keys_file.parent / "state" / "audit.log"
    lines = audit.read_text()
    assert '"action":"auth_failed"' in lines
    assert secret not in lines
