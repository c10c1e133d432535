"""Start the real app once per session: real Ray Serve, real vLLM CPU engines, the real CLI,
through the one stack harness (loadtests/harness/stack.py).

The stack is configs/local.yaml with a few test-only limits (a short context, a small body limit,
a bounded queue) so that every error case can be reached quickly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from loadtests.harness.stack import Stack, StackError, start_stack
from serve_app.config import APP_NAME

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 900
MAX_MODEL_LEN = 65536  # as in configs/local.yaml: agents' prompts fit (tests/integration/test_agents_real.py)
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
KEYS = {"all": ("premium", ["*"]), "embed-only": ("standard", ["minilm-embed"]),
        # tests/integration/test_fuzz.py's corpus, spread over two keys to stay under one key's rpm
        "fuzz-a": ("premium", ["*"]), "fuzz-b": ("premium", ["*"])}

def session_overrides(redis_url: str) -> Any:
    """configs/local.yaml's args with test-only limits, so that every error case is reached quickly."""

    def edit(args: dict[str, Any]) -> None:
        gateway = args["gateway"]
        gateway.update(num_replicas=GATEWAY_REPLICAS, num_cpus=0.25)
        gateway.setdefault("http", {})["max_body_bytes"] = MAX_BODY_BYTES
        gateway.setdefault("state", {})["redis_url"] = redis_url
        gateway.setdefault("keys", {})["reload_interval_s"] = 1.0
        tiny = next(m for m in args["models"] if m["id"] == "tiny-chat")
        tiny["engine"].update(max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS,
                              enable_prefix_caching=True)
        tiny.setdefault("frontend", {})["enable_prompt_tokens_details"] = True  # keeps local.yaml's tools
        tiny["deployment"].update(max_ongoing_requests=MAX_ONGOING, max_queued_requests=MAX_QUEUED)
        tiny["admission"] = {"saturation_requests": SATURATION, "reserved_slots": RESERVED_SLOTS}
        # A second version of the chat model for the weighted split (A/B) and the fallback: a queue
        # of one, so a small burst overflows it onto tiny-chat.
        args["models"].append({
            **{k: v for k, v in tiny.items()
               if k not in ("aliases", "adapters", "admission", "frontend")},
            "id": "tiny-chat-b",
            "fallback": "tiny-chat",
            "engine": {**tiny["engine"], "max_num_seqs": 2, "enable_prefix_caching": False},
            "deployment": {"num_replicas": 1, "max_ongoing_requests": 1, "max_queued_requests": 1},
            "env": {"VLLM_CPU_OMP_THREADS_BIND": "1"},
        })
        args["routes"] = [{"name": "tiny-ab", "split": [{"model": "tiny-chat", "weight": 1},
                                                        {"model": "tiny-chat-b", "weight": 1}]}]

    return edit


@contextlib.contextmanager
def running_stack(workdir: Path, **kwargs: Any) -> Iterator[Stack]:
    """configs/local.yaml started by the stack harness in ``workdir`` (``start_stack``'s keyword
    arguments), a start that fails failing the test, and its whole process tree stopped at the end."""
    try:
        running = start_stack(ROOT / "configs/local.yaml", workdir, **kwargs)
    except StackError as exc:
        pytest.fail(str(exc))
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Stack]:
    """The real app (configs/local.yaml with session_overrides), started once per session by the
    stack harness, with the keys in KEYS; its whole process tree is stopped at the end."""
    with running_stack(tmp_path_factory.mktemp("stack"), keys=KEYS, edit=session_overrides(redis_url),
                       timeout_s=START_TIMEOUT_S) as running:
        try:
            yield running
        finally:
            _disconnect_ray()


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

    # This stack's own cluster, not any cluster on the machine ("auto" picks one at random when
    # several run, e.g. a stack a load tool started beside this one).
    address = stack.ray_address()
    assert address, f"no raylet found in the stack's process tree (pid {stack.proc.pid})"
    # Token auth: tests/conftest.py sets RAY_AUTH_MODE before ray is imported.
    ray.init(address=address, log_to_driver=False, logging_level="ERROR")
    _ray_connected = True

    def get(name: str) -> Any:
        return serve.get_deployment_handle(name, app_name=APP_NAME)

    return get


# Tests marked `cluster` start a Ray cluster of their own and `ray stop` it, so they run first,
# before any test starts the session stack. tryfirst: this sort runs before tests/conftest.py's
# hook, whose stable sort (faults, soak, stops_stack last) keeps them first.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: 0 if item.get_closest_marker("cluster") else 1)
