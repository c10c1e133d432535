"""Start the real app once per session: real Ray Serve, real vLLM CPU engines, the real CLI.

The stack is configs/local.yaml with a few test-only limits (a short context, a small body limit,
a bounded queue) so that every error case can be reached quickly.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from serve_app.gateway.keys import create_key
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 900
MAX_MODEL_LEN = 2048  # as in configs/local.yaml
MAX_BODY_BYTES = 256 * 1024
# The engine runs 4 sequences at once, so requests queue, and tier priority decides their order.
MAX_NUM_SEQS = 4
MAX_ONGOING = 24
MAX_QUEUED = 8
# Batch (shed_at 0.5) is shed above 20 requests in flight: a queue deep enough that premium
# skipping it shows in its TTFT. Capacity is 24 + 8 = 32.
SATURATION = 40
# One of the engine's 4 slots is premium's alone: batch runs 3 at a time.
RESERVED_SLOTS = 1
GATEWAY_REPLICAS = 2


@dataclass
class Stack:
    base_url: str  # ends with /v1
    root_url: str
    keys: dict[str, str]  # key id -> secret
    log: Path
    workdir: Path

    @property
    def keys_file(self) -> Path:
        return self.workdir / "keys.yaml"


def _test_config(workdir: Path, port: int, redis_url: str) -> Path:
    doc = yaml.safe_load((ROOT / "configs/local.yaml").read_text())
    doc["http_options"] = {"host": "127.0.0.1", "port": port}
    args: dict[str, Any] = doc["applications"][0]["args"]
    args["gateway"].update(
        keys_file=str(workdir / "keys.yaml"),
        max_body_bytes=MAX_BODY_BYTES,
        num_replicas=GATEWAY_REPLICAS,
        num_cpus=0.25,
        redis_url=redis_url,
        keys_reload_interval_s=1.0,
    )
    tiny = next(m for m in args["models"] if m["id"] == "tiny-chat")
    tiny["engine"].update(max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS,
                          enable_prefix_caching=True)
    tiny["frontend"] = {"enable_prompt_tokens_details": True}
    tiny["deployment"].update(max_ongoing_requests=MAX_ONGOING, max_queued_requests=MAX_QUEUED)
    tiny["admission"] = {"saturation_requests": SATURATION, "reserved_slots": RESERVED_SLOTS}
    # A second version of the chat model for the weighted split (A/B) and the fallback: a queue
    # of one, so a small burst overflows it onto tiny-chat.
    args["models"].append({
        **{k: v for k, v in tiny.items() if k not in ("aliases", "admission", "frontend")},
        "id": "tiny-chat-b",
        "fallback": "tiny-chat",
        "engine": {**tiny["engine"], "max_num_seqs": 2, "enable_prefix_caching": False},
        "deployment": {"num_replicas": 1, "max_ongoing_requests": 1, "max_queued_requests": 1},
        "env": {"VLLM_CPU_OMP_THREADS_BIND": "1"},
    })
    args["routes"] = [{"name": "tiny-ab", "split": [{"model": "tiny-chat", "weight": 1},
                                                    {"model": "tiny-chat-b", "weight": 1}]}]
    path = workdir / "serve.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Stack]:
    workdir = tmp_path_factory.mktemp("stack")
    port = free_port()
    config = _test_config(workdir, port, redis_url)
    keys_file = workdir / "keys.yaml"
    keys = {
        "all": create_key(keys_file, "all", "premium", ["*"]),
        "embed-only": create_key(keys_file, "embed-only", "standard", ["minilm-embed"]),
    }
    log = workdir / "stack.log"
    ready = workdir / "ready.json"
    with open(log, "wb") as out:
        # Its own process group (so it can be stopped as a whole) but this session: Linux groups CPU
        # time by session ("autogroup"), and in a session of its own the stack, whose engines spin on
        # both cores, left this process, the load client, waiting on the run queue for 9 s of 10
        # (/proc/PID/schedstat), so tests measured the client's starvation. In one session, Ray's
        # nice 15 for its workers lets the client run first, as a client on another host would.
        proc = subprocess.Popen(
            [sys.executable, "-m", "serve_app.cli", "run", "--config", str(config),
             "--ready-file", str(ready), "--timeout", str(START_TIMEOUT_S)],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, process_group=0,
        )
    try:
        t0 = time.monotonic()
        while not ready.exists():
            if proc.poll() is not None:
                pytest.fail(f"the app exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            if time.monotonic() - t0 > START_TIMEOUT_S:
                pytest.fail(f"the app was not ready in {START_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")
            time.sleep(1)
        print(f"\n[stack] ready in {time.monotonic() - t0:.0f} s on port {port}", flush=True)
        base = json.loads(ready.read_text())["base_url"]
        yield Stack(base_url=base, root_url=base.removesuffix("/v1"), keys=keys, log=log, workdir=workdir)
    finally:
        _disconnect_ray()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


_ray_connected = False


def _disconnect_ray() -> None:
    global _ray_connected
    if _ray_connected:
        import ray

        ray.shutdown()
        _ray_connected = False


@pytest.fixture(scope="session")
def serve_handles(stack: Stack) -> Any:
    """Deployment handles into the running app, for facts HTTP does not show (engine internals)."""
    global _ray_connected
    import ray
    from ray import serve

    ray.init(address="auto", log_to_driver=False, logging_level="ERROR")
    _ray_connected = True

    def get(name: str) -> Any:
        return serve.get_deployment_handle(name, app_name="llm")

    return get
