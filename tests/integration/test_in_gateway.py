"""The in-gateway path (``gateway.serve_model``): the same tests, run against a stack whose gateway
replica runs tiny-chat's engine in its own process.

Every test imported below is also collected in its own module, where it runs against the session
stack (the deployment path); here the module's ``stack`` fixture is a second stack, built exactly
like the session stack (``session_overrides``: the same keys, tiers, limits, tiny-chat-b with its
fallback and the A/B route) plus ``gateway.serve_model: tiny-chat``. So one matrix of routes,
errors, tiers, limits, fallback, A/B split, streaming, usage and the real agent CLIs runs on both
paths. Left out here, and why: the tests about two gateway replicas (the in-gateway stack has one,
since its gateway replicas are tiny-chat's one replica) and those that read the model deployment's
handle (tiny-chat has none on this path; ``test_the_path_is_in_process`` reads the gateway's).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from loadtests.harness.stack import Stack, driver_env
from tests.integration.conftest import KEYS, START_TIMEOUT_S, running_stack, session_overrides

# The matrix: these tests run here against the in-gateway stack, and in their modules against the
# session stack. (Their fixtures are imported too: pytest resolves a test's fixtures in the module
# that collects it, so they take this module's `stack`.)
from tests.integration.test_agents_real import (  # noqa: F401
    test_claude_print,
    test_cline,
    test_codex_exec,
)
from tests.integration.test_client_apis import (  # noqa: F401
    claude,
    oai,
    test_count_tokens,
    test_messages_beta_query_and_headers,
    test_messages_create_with_x_api_key,
    test_messages_errors_use_anthropics_envelope,
    test_messages_stream_with_bearer_and_tools,
    test_models_limit,
    test_openai_routes_keep_openais_envelope,
    test_responses_codex_shaped_multi_turn,
    test_responses_create,
    test_responses_stateful_requests_are_400,
    test_responses_stream_with_tools,
    test_root_answers_get_and_head,
    test_score_and_rerank,
    test_tokenize_round_trip,
)
from tests.integration.test_errors import (  # noqa: F401
    test_back_pressure_is_503_with_retry_after,
    test_bad_parameters_are_400_with_param,
    test_body_too_large_is_413_and_wrong_type_is_415,
    test_context_length_exceeded,
    test_health_needs_no_key,
    test_malformed_json_is_400,
    test_missing_and_unknown_keys_are_401,
    test_unknown_and_forbidden_models_are_404,
    test_unknown_path_and_method,
)
from tests.integration.test_generation import (  # noqa: F401
    client,
    test_alias_and_n_and_stop_are_vllms,
    test_chat_completion,
    test_chat_stream_with_usage,
    test_embeddings_are_real,
    test_models_list_per_key,
    test_stream_merges_tokens_without_losing_any,
    test_stream_wire_format_ends_with_done,
    test_text_completion,
)
from tests.integration.test_routing import (  # noqa: F401
    test_fallback_answers_when_the_primary_queue_is_full,
    test_weighted_split_serves_from_both_versions,
)
from tests.integration.test_tiers import (  # noqa: F401
    test_forbidden_upstream_fields_are_400,
    test_overload_sheds_batch_first_and_never_premium,
    test_rate_limit_answers_429_and_the_sdk_recovers,
    test_request_id_is_bounded,
    test_tenants_do_not_share_the_prefix_cache,
)
from tests.integration.test_tools import (  # noqa: F401
    test_cached_tokens_are_reported,
    test_tools_stream_and_a_tool_result_turn,
    test_tools_with_auto_choice_are_answered,
)

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-chat"


def _in_gateway(redis_url: str) -> Any:
    session = session_overrides(redis_url)

    def edit(args: dict[str, Any]) -> None:
        session(args)
        # One gateway replica: it is tiny-chat's one replica (gateway.serve_model's rule).
        args["gateway"].update(serve_model=MODEL, num_replicas=1)

    return edit


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Stack]:
    """A stack like the session stack, with tiny-chat served in the gateway replica. Its own
    Redis database, so that its limits' counters never meet the session stack's (same key ids)."""
    own_db = re.sub(r"/\d+$", "", redis_url) + "/3"
    with running_stack(tmp_path_factory.mktemp("in-gateway"), keys=KEYS, edit=_in_gateway(own_db),
                       timeout_s=START_TIMEOUT_S, retries=1) as running:
        yield running


def test_the_path_is_in_process(stack: Stack) -> None:
    """tiny-chat has no deployment of its own; the gateway's forwarder calls it in its process,
    and the answer's usage and Server-Timing are the deployment path's."""
    key = stack.keys["all"]
    sdk = openai.OpenAI(base_url=stack.base_url, api_key=key, max_retries=0)
    raw = sdk.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    answer = raw.parse()
    assert answer.usage is not None and answer.usage.completion_tokens > 0
    assert "engine;dur=" in raw.headers["server-timing"]
    deadline = time.monotonic() + 60
    transport = None
    while time.monotonic() < deadline:
        out = _diagnose(stack)
        match = re.search(r'"model_transport": "([^"]+)"', out)
        transport = match.group(1) if match else None
        if transport == "in process":
            break
        time.sleep(1)
    assert transport == "in process", out
    assert "served here" in out and '"model": "tiny-chat"' in out, out
    assert "model-tiny-chat:" not in out, out  # no deployment for it


def _diagnose(stack: Stack) -> str:
    """``serve-app diagnose`` as an operator runs it, against this stack's own Ray cluster."""
    done = subprocess.run([sys.executable, "-m", "serve_app.cli", "diagnose"], capture_output=True,
                          text=True, timeout=120, cwd=ROOT, env=driver_env(stack.ray_address() or ""))
    return done.stdout + done.stderr
