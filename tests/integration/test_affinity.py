"""Affinity routing on a real stack: one session's turns land on one model replica.

A stack of its own (module scope): ``tiny-chat`` with two replicas (so ``routing.affinity: auto``
turns the affinity router on) behind two gateway replicas, each with its own router, which must
agree. Which replica served a request is read from vLLM's own counters
(``vllm:request_success`` per ``ReplicaId``) on Ray's metrics export, the same series the
dashboards read.

- The openai SDK sends Claude Code's session header over several turns: every turn on one replica,
  and the later turns hit the prefix cache.
- The real Claude Code CLI (``--session-id``, then ``--resume``): both runs' requests on one replica.
- The real Codex CLI (``codex exec``, then ``codex exec resume --last``): its session id (header
  and ``prompt_cache_key``) keeps both runs on one replica.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
import uuid
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from loadtests.harness.stack import Stack, descendants
from tests.integration.agents import CLIENTS_BIN, can_unshare, run_isolated
from tests.integration.conftest import running_stack
from tests.integration.test_agents_real import claude_env, codex_config
from tests.keys import create_key

pytestmark = pytest.mark.integration

MODEL = "tiny-chat"
TIER = "affinity-test"
SAMPLE = re.compile(r'^(ray_vllm_request_success_total|ray_serve_app_routing_decisions_total)'
                    r'\{([^}]*)\} ([0-9.eE+-]+)$')


def _edit(args: dict[str, Any]) -> None:
    tiny = next(m for m in args["models"] if m["id"] == MODEL)
    tiny.pop("admission", None)
    tiny["engine"].update(enable_prefix_caching=True)
    tiny.setdefault("frontend", {})["enable_prompt_tokens_details"] = True
    tiny["deployment"]["num_replicas"] = 2
    tiny["env"] = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
    args["models"] = [tiny]
    args["routes"] = []
    args["gateway"].update(num_replicas=2, num_cpus=0.25)
    args["gateway"].setdefault("keys", {})["reload_interval_s"] = 1.0
    args["tiers"] = {TIER: {"priority": 0, "description": "no limits (two gateway replicas)"}}
    args["default_tier"] = TIER


@pytest.fixture(scope="module")
def two_replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("affinity"), edit=_edit, timeout_s=900,
                       retries=1) as running:
        yield running


def _export_urls(stack: Stack) -> list[str]:
    address = stack.ray_address() or "127.0.0.1:0"
    session = Path("/tmp/ray/session_latest")
    for pid in descendants(stack.proc.pid):
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        for arg in args:
            if arg.startswith(("--session_dir=", "--session-dir=")):
                session = Path(arg.split("=", 1)[1])
    return [f"http://{address.rsplit(':', 1)[0]}:{int(p.read_text())}/metrics"
            for p in session.glob("metrics_export_port_*")]


def _counts(stack: Stack) -> dict[tuple[str, str], float]:
    """(metric, ReplicaId or decision) -> value, for tiny-chat."""
    out: dict[tuple[str, str], float] = defaultdict(float)
    for url in _export_urls(stack):
        with urllib.request.urlopen(url, timeout=10) as r:  # noqa: S310 (the node's own export)
            for line in r.read().decode().splitlines():
                m = SAMPLE.match(line)
                if not m:
                    continue
                labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
                if m.group(1).startswith("ray_vllm") and labels.get("model_name") == MODEL:
                    out[(m.group(1), labels.get("ReplicaId", ""))] += float(m.group(3))
                elif labels.get("deployment") == "model-tiny-chat":
                    out[(m.group(1), labels.get("decision", ""))] += float(m.group(3))
    return dict(out)


def _settled(stack: Stack, before: dict[tuple[str, str], float], served: int) -> dict[str, float]:
    """Per-replica requests since ``before``, once Ray's export shows ``served`` of them."""
    deadline = time.monotonic() + 90
    per: dict[str, float] = {}
    while time.monotonic() < deadline:
        now = _counts(stack)
        per = {k[1]: v - before.get(k, 0.0) for k, v in now.items()
               if k[0] == "ray_vllm_request_success_total" and v - before.get(k, 0.0) > 0}
        if sum(per.values()) >= served:
            return per
        time.sleep(3)
    return per


def _key(stack: Stack, name: str) -> str:
    secret = create_key(stack.keys_file, name, TIER, ["*"])
    stack.wait_keys(accepted=[secret])
    return secret


def test_sdk_session_turns_land_on_one_replica(two_replicas: Stack) -> None:
    stack = two_replicas
    client = openai.OpenAI(base_url=stack.base_url, api_key=_key(stack, "sdk-session"))
    session = {"X-Claude-Code-Session-Id": str(uuid.uuid4())}
    system = "You are a coding agent. " + "read the file then edit it carefully " * 120
    before = _counts(stack)
    messages: list[Any] = [{"role": "system", "content": system}]
    cached = []
    turns = 6
    for turn in range(turns):
        messages.append({"role": "user", "content": f"turn {turn}: run the tests and fix them"})
        answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                                temperature=0, extra_headers=session)
        messages.append({"role": "assistant", "content": answer.choices[0].message.content or ""})
        details = answer.usage.prompt_tokens_details if answer.usage else None
        cached.append(details.cached_tokens if details and details.cached_tokens else 0)
    per_replica = _settled(stack, before, turns)

    def decided() -> dict[str, float]:
        return {k[1]: v - before.get(k, 0.0) for k, v in _counts(stack).items()
                if k[0] == "ray_serve_app_routing_decisions_total"}

    # The gateway's counters reach Ray's export on their own schedule, apart from the engines'
    # (CI once read none at all here, every turn already on one replica): wait for all of them.
    deadline = time.monotonic() + 60
    decisions = decided()
    while sum(decisions.values()) < turns and time.monotonic() < deadline:
        time.sleep(2)
        decisions = decided()
    print(f"\n[sdk] per replica {per_replica}; cached tokens {cached}; decisions {decisions}")
    assert list(per_replica.values()) == [turns], per_replica  # every turn on one replica
    assert all(c > 0 for c in cached[1:]), cached  # so every later turn hits the prefix cache
    # Each gateway replica's router sees the key first once ("new"), then keeps it ("affinity");
    # both sent it to the same replica (above): two routers that share nothing agree.
    assert decisions.get("new", 0) <= 2 and decisions.get("spill", 0) == 0
    assert decisions.get("new", 0) + decisions.get("affinity", 0) == turns


def _agent_runs_land_on_one_replica(stack: Stack, tmp_path: Path, name: str, runs: list[list[str]],
                                    env: dict[str, str], route: str) -> None:
    """Run the agent once per argv of ``runs`` (one session: the later runs resume it) in a
    network namespace that reaches only the stack; every generation (``POST route``) must land
    on one model replica."""
    port = httpx.URL(stack.base_url).port
    assert port is not None
    before = _counts(stack)
    served = 0
    for argv in runs:
        proc, bridge = run_isolated(argv, port=port, workdir=tmp_path, env=env, timeout=600, stdin="")
        print(f"\n[{name} {' '.join(argv[1:4])}] exit {proc.returncode}; requests {bridge.requests}; "
              f"statuses {bridge.statuses}; stderr {proc.stderr[-800:]!r}")
        assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-2000:])
        served += sum(1 for r in bridge.requests if r.split("?")[0] == f"POST {route}")
    per_replica = _settled(stack, before, served)
    print(f"[{name}] {served} generations; per replica {json.dumps(per_replica)}")
    assert served >= 2
    assert len(per_replica) == 1, per_replica  # every run of the session on one replica


def _need_agent(binary: str) -> None:
    if not (CLIENTS_BIN / binary).exists():
        pytest.skip(f"{binary} is not installed: run `make clients`")
    if not can_unshare():
        pytest.skip("cannot create a network namespace (needs root): the agent would reach the internet")


def test_claude_code_turns_land_on_one_replica(two_replicas: Stack, tmp_path: Path) -> None:
    _need_agent("claude")
    stack = two_replicas
    home = tmp_path / "home"
    home.mkdir()
    env = {"PATH": f"{CLIENTS_BIN}:/usr/bin:/bin:/usr/sbin:/sbin",
           **claude_env(stack.root_url, home, _key(stack, "agent-claude-affinity"), MODEL)}
    sid = str(uuid.uuid4())
    # Generations only (count_tokens runs no engine request): "POST /v1/messages?beta=true".
    runs = [["claude", "-p", "Say hello in one word.", "--model", MODEL, *args]
            for args in (["--session-id", sid], ["--resume", sid])]
    _agent_runs_land_on_one_replica(stack, tmp_path, "claude", runs, env, "/v1/messages")


def test_codex_turns_land_on_one_replica(two_replicas: Stack, tmp_path: Path) -> None:
    _need_agent("codex")
    stack = two_replicas
    codex_home = tmp_path / "codex-home"
    codex_home.mkdir()
    (codex_home / "config.toml").write_text(codex_config(stack.base_url, MODEL))
    home = tmp_path / "home"
    home.mkdir()
    env = {"PATH": f"{CLIENTS_BIN}:/usr/bin:/bin:/usr/sbin:/sbin", "HOME": str(home),
           "CODEX_HOME": str(codex_home), "SERVE_APP_API_KEY": _key(stack, "agent-codex-affinity")}
    runs = [["codex", "exec", "--skip-git-repo-check", "Say hello in one word."],
            ["codex", "exec", "--skip-git-repo-check", "resume", "--last", "Now say bye."]]
    _agent_runs_land_on_one_replica(stack, tmp_path, "codex", runs, env, "/v1/responses")
