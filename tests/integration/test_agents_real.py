"""The real coding agents, pinned (scripts/install-clients.sh puts them in .clients/), configured as
docs/CLIENTS.md says, complete a prompt against the test stack.

How no traffic leaves the machine: each CLI runs inside its own network namespace
(``unshare --net``, tests/integration/agents.py) whose only interface is loopback, with the stack's
port bridged in through a Unix socket. Vendor hosts do not resolve there, and telemetry is also
turned off in each tool's own settings. Each agent gets a fresh HOME (and CODEX_HOME) and a key of
its own, so the gateway's /v1/usage for that key counts exactly that agent's requests.

The tiny model's text is random: these tests check the conversation (exit code 0, an answer printed,
the requests the gateway served), not what the answer says.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from loadtests.harness.faults import kill_and_replace
from tests.integration.agents import CLIENTS_BIN, can_unshare, run_isolated
from tests.keys import create_key

pytestmark = pytest.mark.integration

TIMEOUT_S = 600  # a first agent turn prefills a ~30k-token prompt on a 2-core CPU


@pytest.fixture(scope="module", autouse=True)
def _clients_available() -> None:
    missing = [b for b in ("codex", "claude") if not (CLIENTS_BIN / b).exists()]
    why = None
    if missing:
        why = f"agent CLIs not installed ({', '.join(missing)}): run `make clients`"
    elif not can_unshare():
        why = "cannot create a network namespace (needs root): the agents would reach the internet"
    if why:
        pytest.skip(why)


def _agent_key(stack: Any, name: str) -> str:
    secret = create_key(stack.keys_file, name, "premium", ["*"])
    stack.wait_keys(accepted=[secret])  # every gateway replica has re-read the keys file
    return secret


def _usage(stack: Any, secret: str) -> dict[str, Any]:
    """The key's /v1/usage once its requests are booked (the books close just after a stream)."""
    usage: dict[str, Any] = {}
    for _ in range(20):
        usage = httpx.get(f"{stack.base_url}/usage", timeout=10,
                          headers={"Authorization": f"Bearer {secret}"}).json()
        if usage["requests"] > 0:
            break
        time.sleep(0.5)
    return usage


def _port(stack: Any) -> int:
    port = httpx.URL(stack.base_url).port
    assert port is not None
    return port


def _report(name: str, proc: Any, bridge: Any, usage: dict[str, Any]) -> None:
    print(f"\n[{name}] exit {proc.returncode}; {bridge.connections} connections")
    print(f"[{name}] requests: {bridge.requests}")
    print(f"[{name}] statuses: {bridge.statuses}")
    print(f"[{name}] usage: {json.dumps(usage)}")
    print(f"[{name}] stdout: {proc.stdout[-600:]!r}")
    print(f"[{name}] stderr: {proc.stderr[-1500:]!r}")


def codex_config(base_url: str, model: str = "tiny-chat", context: int = 65536) -> str:
    """docs/CLIENTS.md's Codex recipe (wire_api must be "responses"; the key is read from the
    variable that env_key names)."""
    return f'''model = "{model}"
model_provider = "serve-app"
model_context_window = {context}
check_for_update_on_startup = false

[analytics]
enabled = false

[feedback]
enabled = false

[model_providers.serve-app]
name = "serve-app"
base_url = "{base_url}"
env_key = "SERVE_APP_API_KEY"
wire_api = "responses"
'''


def codex_env(stack: Any, tmp_path: Path, secret: str) -> dict[str, str]:
    """A fresh HOME and CODEX_HOME with docs/CLIENTS.md's config, and the key in its variable."""
    codex_home = tmp_path / "codex-home"
    codex_home.mkdir()
    (codex_home / "config.toml").write_text(codex_config(stack.base_url))
    home = tmp_path / "home"
    home.mkdir()
    return {"PATH": f"{CLIENTS_BIN}:/usr/bin:/bin:/usr/sbin:/sbin", "HOME": str(home),
            "CODEX_HOME": str(codex_home), "SERVE_APP_API_KEY": secret}


def test_codex_exec(stack: Any, tmp_path: Path) -> None:
    secret = _agent_key(stack, "agent-codex")
    env = codex_env(stack, tmp_path, secret)
    proc, bridge = run_isolated(
        ["codex", "exec", "--skip-git-repo-check", "Say hello in one word."],
        port=_port(stack), workdir=tmp_path, env=env, timeout=TIMEOUT_S, stdin="",
    )
    usage = _usage(stack, secret)
    _report("codex", proc, bridge, usage)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "POST /v1/responses" in bridge.requests
    # Codex tries a WebSocket on /v1/responses only for a provider with supports_websockets =
    # true (a custom provider's default is false): the recipe pays no failed upgrade.
    assert not any(r.startswith("GET /v1/responses") for r in bridge.requests), bridge.requests
    assert "404" not in bridge.statuses and "401" not in bridge.statuses
    assert usage["requests"] >= 1 and usage["completion_tokens"] > 0
    assert usage["prompt_tokens"] > 5000  # Codex's instructions and tools reached the model


def test_codex_session_of_three_turns_through_a_gateway_death(stack: Any, tmp_path: Path) -> None:
    """A Codex session resumed twice (`codex exec resume --last`), with a gateway replica killed
    between turns 2 and 3: Codex sends its whole conversation each turn (store: false), so the
    session does not depend on any gateway or engine replica."""
    secret = _agent_key(stack, "agent-codex-3")
    env = codex_env(stack, tmp_path, secret)
    prompts: list[int] = []  # each turn's prompt tokens per request, from the gateway's books
    seen = {"requests": 0, "prompt_tokens": 0}

    def turn(*args: str) -> None:
        proc, bridge = run_isolated(["codex", "exec", "--skip-git-repo-check", *args],
                                    port=_port(stack), workdir=tmp_path, env=env,
                                    timeout=TIMEOUT_S, stdin="")
        _report(f"codex turn {len(prompts) + 1}", proc, bridge, {})
        assert proc.returncode == 0, proc.stderr[-3000:]
        usage: dict[str, Any] = {}
        for _ in range(20):
            usage = httpx.get(f"{stack.base_url}/usage", timeout=10,
                              headers={"Authorization": f"Bearer {secret}"}).json()
            if usage["requests"] > seen["requests"]:
                break
            time.sleep(0.5)
        requests = usage["requests"] - seen["requests"]
        assert requests >= 1
        prompts.append((usage["prompt_tokens"] - seen["prompt_tokens"]) // requests)
        seen.update(requests=usage["requests"], prompt_tokens=usage["prompt_tokens"])

    turn("Say hello in one word.")
    turn("resume", "--last", "Say it again.")
    kill_and_replace(stack.proc.pid, "gateway")
    turn("resume", "--last", "Once more.")
    print(f"[codex session] prompt tokens per request, by turn: {prompts}")
    assert prompts[0] < prompts[1] < prompts[2]  # each turn carried the conversation so far


def claude_env(root_url: str, home: Path, secret: str, model: str = "tiny-chat") -> dict[str, str]:
    """docs/CLIENTS.md's Claude Code recipe: the base URL without /v1, the key as
    ANTHROPIC_API_KEY (sent as x-api-key), every model alias on the served model, onboarding
    marked done (so no OAuth login is attempted), telemetry and non-essential traffic off."""
    (home / ".claude.json").write_text(json.dumps({"hasCompletedOnboarding": True}))
    return {
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": root_url,
        "ANTHROPIC_API_KEY": secret,
        "ANTHROPIC_MODEL": model,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": model,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
        "ANTHROPIC_SMALL_FAST_MODEL": model,
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_AUTOUPDATER": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }


def test_claude_print(stack: Any, tmp_path: Path) -> None:
    secret = _agent_key(stack, "agent-claude")
    home = tmp_path / "home"
    home.mkdir()
    env = {"PATH": f"{CLIENTS_BIN}:/usr/bin:/bin:/usr/sbin:/sbin",
           **claude_env(stack.root_url, home, secret)}
    proc, bridge = run_isolated(
        ["claude", "-p", "Say hello in one word.", "--model", "tiny-chat"],
        port=_port(stack), workdir=tmp_path, env=env, timeout=TIMEOUT_S, stdin="",
    )
    usage = _usage(stack, secret)
    _report("claude", proc, bridge, usage)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-2000:])
    assert any(r.startswith("POST /v1/messages") for r in bridge.requests)
    assert "404" not in bridge.statuses and "401" not in bridge.statuses
    assert usage["requests"] >= 1 and usage["completion_tokens"] > 0


def test_cline(stack: Any, tmp_path: Path) -> None:
    """docs/CLIENTS.md's Cline CLI recipe: an OpenAI-compatible provider at the /v1 base URL. The
    hub daemon Cline starts is killed with the namespace (tests/integration/agents.py)."""
    if not (CLIENTS_BIN / "cline").exists():
        pytest.skip("cline is not installed: run `make clients`")
    secret = _agent_key(stack, "agent-cline")
    home = tmp_path / "home"
    home.mkdir()
    env = {"PATH": f"{CLIENTS_BIN}:/usr/bin:/bin:/usr/sbin:/sbin", "HOME": str(home)}
    script = (f"cline auth -p openai -k {secret} -m tiny-chat -b {stack.base_url} "
              "&& cline --json -t 300 'Say hello in one word.'")
    proc, bridge = run_isolated(["sh", "-c", script], port=_port(stack), workdir=tmp_path,
                                env=env, timeout=TIMEOUT_S, stdin="")
    usage = _usage(stack, secret)
    _report("cline", proc, bridge, usage)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-2000:])
    assert "POST /v1/chat/completions" in bridge.requests
    assert "404" not in bridge.statuses and "401" not in bridge.statuses
    result = [json.loads(ln) for ln in proc.stdout.splitlines()
              if ln.startswith("{") and '"run_result"' in ln]
    assert result and result[-1]["finishReason"] != "error", result
    assert usage["requests"] >= 1 and usage["completion_tokens"] > 0


def _spend(stack: Any, secret: str) -> None:
    """One direct request with ``secret``: it uses up a 1-request-per-minute limit, or a tiny
    budget (admitted or not, the budget is spent afterwards)."""
    httpx.post(f"{stack.base_url}/chat/completions", timeout=120,
               headers={"Authorization": f"Bearer {secret}"},
               json={"model": "tiny-chat", "max_tokens": 4,
                     "messages": [{"role": "user", "content": "hi"}]})


def _claude(stack: Any, tmp_path: Path, secret: str) -> tuple[Any, Any, float]:
    home = tmp_path / "home"
    home.mkdir()
    env = {"PATH": f"{CLIENTS_BIN}:/usr/bin:/bin:/usr/sbin:/sbin",
           **claude_env(stack.root_url, home, secret)}
    t0 = time.monotonic()
    proc, bridge = run_isolated(
        ["claude", "-p", "Say hello in one word.", "--model", "tiny-chat"],
        port=_port(stack), workdir=tmp_path, env=env, timeout=TIMEOUT_S, stdin="",
    )
    return proc, bridge, time.monotonic() - t0


def test_claude_stops_at_once_on_a_spent_budget(stack: Any, tmp_path: Path) -> None:
    """A budget that is spent: 429 insufficient_quota with x-should-retry: false and the seconds
    to the budget's reset. Claude Code stops at its first refusal and prints the gateway's
    message, instead of retrying a bare 429 for minutes."""
    secret = create_key(stack.keys_file, "agent-claude-broke", "premium", ["*"],
                        budget={"tokens": 1, "period": "day"})
    stack.wait_keys(accepted=[secret])
    _spend(stack, secret)
    proc, bridge, took = _claude(stack, tmp_path, secret)
    _report("claude (spent budget)", proc, bridge, {})
    model_calls = [r for r in bridge.requests if r.startswith("POST /v1/messages ")
                   or r.startswith("POST /v1/messages?")]
    print(f"[claude (spent budget)] {len(model_calls)} model requests, {took:.1f} s")
    assert proc.returncode != 0
    assert len(model_calls) == 1, bridge.requests  # no retry
    assert "budget" in (proc.stdout + proc.stderr).lower()  # the gateway's message is shown
    assert took < 60, took  # it did not sit out the budget's reset (a day) or retry for minutes


def test_claude_waits_out_an_rpm_limit_and_succeeds(stack: Any, tmp_path: Path) -> None:
    """A key at its requests-per-minute limit: 429 with Retry-After the true seconds until the
    window has room (at most 60). Claude Code waits that long and then gets its answer."""
    secret = create_key(stack.keys_file, "agent-claude-rpm", "premium", ["*"],
                        limits={"rpm": 1})
    stack.wait_keys(accepted=[secret])
    _spend(stack, secret)
    proc, bridge, took = _claude(stack, tmp_path, secret)
    usage = _usage(stack, secret)
    _report("claude (rpm 1)", proc, bridge, usage)
    print(f"[claude (rpm 1)] statuses {bridge.statuses}, {took:.1f} s")
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-2000:])
    assert "429" in bridge.statuses, bridge.statuses
    assert "200" in bridge.statuses[bridge.statuses.index("429"):], bridge.statuses
    assert usage["rejections"].get("rate_limit", 0) >= 1
