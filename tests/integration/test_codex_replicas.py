"""A Codex session through a model replica's death and a gateway replica's restart, with two model
replicas: issue 40's "done when" for Codex. Its own stack (configs/local.yaml with tiny-chat at two
replicas and no embedding model), started before the session stack (``cluster``), so two stacks
never share the machine."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from loadtests.harness.faults import find_replicas, kill_and_replace
from loadtests.harness.stack import Stack
from tests.integration.agents import CLIENTS_BIN, can_unshare, run_isolated
from tests.integration.conftest import running_stack
from tests.integration.test_agents_real import TIMEOUT_S, codex_env

pytestmark = [pytest.mark.integration, pytest.mark.cluster]

MODEL_DEPLOYMENT = "model-tiny-chat"


def _two_replicas(args: dict[str, Any]) -> None:
    args["models"] = [m for m in args["models"] if m["id"] == "tiny-chat"]
    args["models"][0]["deployment"]["num_replicas"] = 2


@pytest.fixture(scope="module")
def two_replica_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    if not (CLIENTS_BIN / "codex").exists():
        pytest.skip("codex is not installed: run `make clients`")
    if not can_unshare():
        pytest.skip("cannot create a network namespace (needs root)")
    with running_stack(tmp_path_factory.mktemp("codex-replicas"), keys={"agent": ("premium", ["*"])},
                       edit=_two_replicas, timeout_s=900) as stack:
        yield stack


def _requests(stack: Stack, secret: str) -> tuple[int, int]:
    usage = httpx.get(f"{stack.base_url}/usage", timeout=10,
                      headers={"Authorization": f"Bearer {secret}"}).json()
    return int(usage["requests"]), int(usage["prompt_tokens"])


def test_codex_session_through_a_model_replica_death_and_a_gateway_restart(
        two_replica_stack: Stack, tmp_path: Path) -> None:
    stack = two_replica_stack
    secret = stack.keys["agent"]
    env = codex_env(stack, tmp_path, secret)
    port = httpx.URL(stack.base_url).port
    assert port is not None
    prompts: list[int] = []
    seen = (0, 0)

    def turn(*args: str) -> None:
        nonlocal seen
        proc, bridge = run_isolated(["codex", "exec", "--skip-git-repo-check", *args], port=port,
                                    workdir=tmp_path, env=env, timeout=TIMEOUT_S, stdin="")
        print(f"[codex turn {len(prompts) + 1}] exit {proc.returncode}; {bridge.requests} "
              f"-> {bridge.statuses}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        for _ in range(20):
            now = _requests(stack, secret)
            if now[0] > seen[0]:
                break
            time.sleep(0.5)
        prompts.append((now[1] - seen[1]) // max(1, now[0] - seen[0]))
        seen = now

    assert len(find_replicas(stack.proc.pid, MODEL_DEPLOYMENT)) == 2
    turn("Say hello in one word.")
    # One model replica dies: the other answers the next turn (Ray Serve replaces the dead one).
    os.kill(find_replicas(stack.proc.pid, MODEL_DEPLOYMENT)[0], signal.SIGKILL)
    turn("resume", "--last", "Say it again.")
    kill_and_replace(stack.proc.pid, "gateway")  # the gateway restarts
    turn("resume", "--last", "Once more.")
    print(f"[codex, two replicas] prompt tokens per request, by turn: {prompts}")
    assert prompts[0] < prompts[1] < prompts[2]  # each turn carried the conversation so far
