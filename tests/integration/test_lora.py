"""LoRA adapters as models (issue 41) on the real stack: configs/local.yaml's tiny-chat serves its
builtin adapter tiny-chat-pirate through vLLM's LoRA support (the CPU punica wrapper).

The openai SDK calls the adapter by name through the gateway; its greedy output differs from the
base model's, and matches plain vLLM (``python -m vllm.entrypoints.openai.api_server`` with
``--lora-modules``, the same engine arguments and the same adapter folder) token for token. The
listing shows the adapter as vLLM does (parent the base model), without a server path, and a key
whose models do not name the adapter gets the 404 of a model that does not exist.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import BadRequestError, NotFoundError, OpenAI

from loadtests.bench.procs import direct_server_flags, start_direct
from loadtests.harness.stack import (
    CLI,
    ROOT,
    Stack,
    free_port,
    http_status,
    keys_create,
    read_config,
    stop,
)
from serve_app.engine.sources import builtin_adapter_path, builtin_path

pytestmark = pytest.mark.integration

BASE, ADAPTER = "tiny-chat", "tiny-chat-pirate"
# A prompt no other test sends, so neither side reuses prefix-cached blocks from earlier requests.
PROMPT = "Pirate test 41: tell me about the river city and the green tree, please"
MAX_TOKENS = 16
DIRECT_START_S = 300.0


def _greedy(client: OpenAI, model: str) -> tuple[str, list[str], int]:
    """The text, the tokens (from logprobs) and the completion token count of a greedy answer."""
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPT}], temperature=0,
        max_tokens=MAX_TOKENS, logprobs=True, seed=0)
    choice = r.choices[0]
    assert r.model == model
    tokens = [t.token for t in (choice.logprobs.content or [])] if choice.logprobs else []
    assert r.usage is not None
    return choice.message.content or "", tokens, r.usage.completion_tokens


@contextlib.contextmanager
def plain_vllm(stack: Stack, workdir: Path) -> Iterator[str]:
    """vLLM's own OpenAI server on tiny-chat's folder with the adapter's folder as a LoRA module,
    with the engine arguments the stack gives tiny-chat's engine; its base URL."""
    cfg = read_config(stack.config)
    tiny = cfg.model(BASE)
    model_path = str(builtin_path(BASE, cfg.cache_dir))
    adapter_path = str(builtin_adapter_path(ADAPTER, cfg.cache_dir))
    assert Path(adapter_path, "adapter_config.json").is_file(), "the replica built the adapter"
    frontend = {k: v for k, v in tiny.frontend.items() if k != "lora_modules"}
    flags = direct_server_flags(tiny.engine_kwargs(model_path), frontend)
    flags += ["--lora-modules", f"{ADAPTER}={adapter_path}"]
    port = free_port("127.0.0.1")
    proc = start_direct(flags, port, dict(tiny.env), workdir / "direct.log")
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + DIRECT_START_S
        while http_status(f"{url}/health", 5) != 200:
            assert proc.alive(), f"plain vLLM exited:\n{proc.log_tail()}"
            assert time.monotonic() < deadline, f"plain vLLM not ready:\n{proc.log_tail()}"
            time.sleep(1)
        yield url + "/v1"
    finally:
        stop(proc)


def test_adapter_through_the_gateway_matches_plain_vllm_token_for_token(
        stack: Stack, tmp_path: Path) -> None:
    gateway = OpenAI(base_url=stack.base_url, api_key=stack.keys["all"], max_retries=0, timeout=120)
    base = _greedy(gateway, BASE)
    adapted = _greedy(gateway, ADAPTER)
    assert adapted[2] > 0 and adapted[1], adapted
    assert adapted[1] != base[1], "the adapter changes nothing: is it applied?"
    # Streamed through the gateway too: the same tokens, under the adapter's name.
    stream = gateway.chat.completions.create(
        model=ADAPTER, messages=[{"role": "user", "content": PROMPT}], temperature=0,
        max_tokens=MAX_TOKENS, seed=0, stream=True)
    chunks = list(stream)
    assert {c.model for c in chunks} == {ADAPTER}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == adapted[0]

    time.sleep(2)  # the stack's engine busy-waits for about a second after its last request
    with plain_vllm(stack, tmp_path) as url:
        direct = OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)
        listed = {m.id: m for m in direct.models.list().data}
        assert getattr(listed[ADAPTER], "parent", None) == BASE
        assert _greedy(direct, ADAPTER) == adapted
        assert _greedy(direct, BASE) == base


def test_models_lists_the_adapter_as_vllm_does_without_a_path(stack: Stack) -> None:
    r = httpx.get(f"{stack.base_url}/models", timeout=30,
                  headers={"Authorization": f"Bearer {stack.keys['all']}"})
    assert r.status_code == 200
    cards = {c["id"]: c for c in r.json()["data"]}
    card = cards[ADAPTER]
    assert (card["parent"], card["root"]) == (BASE, "builtin:tiny-chat-pirate")
    assert card["root"] != card["parent"]
    assert cards["tiny"]["root"] == cards["tiny"]["parent"] == BASE  # an alias looks different
    assert "/" not in card["root"] and ".cache" not in r.text


def test_a_key_without_the_adapter_gets_the_404_of_an_unknown_model(stack: Stack) -> None:
    secret = keys_create(stack.keys_file, "lora-base-only", "standard", [BASE])
    stack.wait_keys(accepted=[secret])
    client = OpenAI(base_url=stack.base_url, api_key=secret, max_retries=0, timeout=120)
    assert client.chat.completions.create(
        model=BASE, messages=[{"role": "user", "content": "hi"}], max_tokens=2).choices
    answers: dict[str, Any] = {}
    for name in (ADAPTER, "tiny-chat-parrot"):
        with pytest.raises(NotFoundError) as exc_info:
            client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        body = exc_info.value.body
        assert isinstance(body, dict)
        answers[name] = {k: (v.replace(name, "<name>") if isinstance(v, str) else v)
                         for k, v in body.items()}
    assert answers[ADAPTER] == answers["tiny-chat-parrot"]
    listed = [m.id for m in client.models.list().data]
    assert ADAPTER not in listed and BASE in listed


def test_prompt_logprobs_are_a_400_and_the_engine_lives(stack: Stack) -> None:
    """With LoRA on, vLLM's engine dies on prompt log-probabilities (vllm#16668): the fuzz corpus
    found it, a request of any key taking down every stream on the replica. The replica refuses
    each way of asking, beside a base-model request in flight, and keeps answering."""
    client = OpenAI(base_url=stack.base_url, api_key=stack.keys["all"], max_retries=0, timeout=120)
    stream = client.chat.completions.create(model=BASE, messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=32, stream=True)
    asks: list[tuple[str, dict[str, Any]]] = [
        ("chat", {"extra_body": {"prompt_logprobs": 0}}),
        ("chat", {"extra_body": {"echo": True}}),
        ("completions", {"extra_body": {"prompt_logprobs": 1}}),
        ("completions", {"echo": True, "logprobs": 0}),
    ]
    for endpoint, extra in asks:
        for model in (BASE, ADAPTER):
            with pytest.raises(BadRequestError) as info:
                if endpoint == "chat":
                    client.chat.completions.create(
                        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2, **extra)
                else:
                    client.completions.create(model=model, prompt="hi", max_tokens=2, **extra)
            body = info.value.body
            assert isinstance(body, dict) and body["param"] in ("prompt_logprobs", "echo"), body
            assert "LoRA" in body["message"]
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert client.chat.completions.create(
        model=ADAPTER, messages=[{"role": "user", "content": "hi"}], max_tokens=2).choices


def _admin(stack: Stack) -> str:
    """A new admin key (``serve-app keys create --role admin``), once every gateway replica
    answers it on the admin API twice in a row per replica."""
    done = subprocess.run([*CLI, "keys", "create", "--config", str(stack.config), "--id",
                           f"lora-admin-{uuid.uuid4().hex[:6]}", "--role", "admin"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    secret = done.stdout.strip().splitlines()[-1]
    streak, deadline = 0, time.monotonic() + 30
    while streak < 2 * read_config(stack.config).gateway.num_replicas:
        ok = http_status(f"{stack.root_url}/admin/v1/keys", 10, {"Authorization": f"Bearer {secret}"}) == 200
        streak = streak + 1 if ok else 0
        assert time.monotonic() < deadline, "the gateway did not pick up the admin key"
        time.sleep(0.1)
    return secret


def test_an_adapters_usage_is_kept_apart_from_its_base_models(stack: Stack) -> None:
    key_id = f"lora-usage-{uuid.uuid4().hex[:6]}"
    secret = keys_create(stack.keys_file, key_id, "standard", [BASE, ADAPTER])
    stack.wait_keys(accepted=[secret])
    client = OpenAI(base_url=stack.base_url, api_key=secret, max_retries=0, timeout=120)
    for model, n in ((ADAPTER, 2), (BASE, 1)):
        for _ in range(n):
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=3, temperature=0)
    admin = {"Authorization": f"Bearer {_admin(stack)}"}

    def requests(model: str | None) -> int:
        r = httpx.get(f"{stack.root_url}/admin/v1/usage", headers=admin, timeout=10,
                      params={"key_id": key_id, **({"model": model} if model else {})})
        assert r.status_code == 200, r.text
        return int(r.json()["requests"])

    deadline = time.monotonic() + 10  # the books are written just after each answer
    while requests(None) < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert (requests(ADAPTER), requests(BASE), requests(None)) == (2, 1, 3)


def _until(what: str, check: Any, timeout_s: float) -> float:
    """Seconds until ``check()`` is true (polled), or fail naming ``what``."""
    t0 = time.monotonic()
    while not check():
        assert time.monotonic() - t0 < timeout_s, f"{what}: not within {timeout_s} s"
        time.sleep(0.2)
    return time.monotonic() - t0


def _stream(client: OpenAI, model: str, out: dict[str, Any]) -> None:
    """A long greedy stream (ignore_eos): its text and completion tokens into ``out``."""
    try:
        chunks = list(client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": PROMPT}], temperature=0, max_tokens=400,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
        out["text"] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        out["tokens"] = next(c.usage.completion_tokens for c in chunks if c.usage)
    except Exception as exc:  # noqa: BLE001 - the assertion below shows it
        out["error"] = repr(exc)


def test_an_adapter_added_at_run_time_answers_survives_a_replica_restart_and_leaves_cleanly(
        stack: Stack, tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from loadtests.harness.faults import kill_and_replace

    admin = {"Authorization": f"Bearer {_admin(stack)}"}
    name = f"pirate-rt-{uuid.uuid4().hex[:6]}"
    secret = keys_create(stack.keys_file, f"lora-rt-{uuid.uuid4().hex[:6]}", "premium", [BASE, ADAPTER, name])
    stack.wait_keys(accepted=[secret])
    client = OpenAI(base_url=stack.base_url, api_key=secret, max_retries=0, timeout=120)
    pirate = _greedy(client, ADAPTER)

    def post(body: dict[str, Any]) -> httpx.Response:
        return httpx.post(f"{stack.root_url}/admin/v1/adapters", headers=admin, json=body, timeout=90)

    try:
        # Bad input is refused with the reason, and nothing that serves is disturbed.
        cfg = read_config(stack.config)
        wide = tmp_path / "wide"
        wide.mkdir()
        src = builtin_adapter_path(ADAPTER, cfg.cache_dir)
        for f in src.iterdir():
            (wide / f.name).write_bytes(f.read_bytes())
        doc = json.loads((wide / "adapter_config.json").read_text())
        (wide / "adapter_config.json").write_text(json.dumps({**doc, "r": 16}))
        for body, status, words in (
                ({"name": name, "model": BASE, "source": str(tmp_path / "missing")}, 400, "adapter_config.json"),
                ({"name": name, "model": BASE, "source": str(wide)}, 400, "max_lora_rank"),
                ({"name": BASE, "model": BASE, "source": "builtin:tiny-chat-pirate"}, 409, "already"),
                ({"name": name, "model": "minilm-embed", "source": "builtin:tiny-chat-pirate"}, 400, "LoRA")):
            r = post(body)
            assert r.status_code == status and words in r.json()["error"]["message"], r.text
        with pytest.raises(NotFoundError):
            client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert _greedy(client, BASE)[2] > 0

        # Added: it answers within 10 s, as the configured adapter with the same weights does.
        t0 = time.monotonic()
        r = post({"name": name, "model": BASE, "source": "builtin:tiny-chat-pirate"})
        assert r.status_code == 201, r.text
        got = _greedy(client, name)
        added_s = time.monotonic() - t0
        print(f"\n[lora] run-time adapter answered {added_s:.1f} s after the POST began")
        assert added_s < 10 and got[1] == pirate[1]

        # A model replica restart: the new replica loads it on its first request (the record is in
        # the state layer, not in the replica).
        kill_and_replace(stack.proc.pid, "model-tiny-chat", timeout_s=300)
        _until("tiny-chat answers after its restart", lambda: http_status(
            f"{stack.base_url}/chat/completions", 60, {"Authorization": f"Bearer {secret}"},
            {"model": BASE, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}) == 200, 300)
        assert _greedy(client, name)[1] == pirate[1]

        # Removed while a stream on it and one on the base model run: both finish whole; new calls
        # get the 404 of a model that does not exist, on every gateway replica.
        outs: list[dict[str, Any]] = [{}, {}]
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(_stream, client, m, o) for m, o in zip((name, BASE), outs, strict=True)]
            time.sleep(1.0)
            r = httpx.delete(f"{stack.root_url}/admin/v1/adapters/{name}", headers=admin, timeout=30)
            assert r.status_code == 200, r.text
            for f in futures:
                f.result(timeout=300)
        assert [o.get("tokens") for o in outs] == [400, 400], outs

        def refused() -> bool:
            try:
                client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=2)
            except NotFoundError:
                return True
            return False

        _until("every gateway replica refuses the removed adapter", lambda: all(refused() for _ in range(4)), 15)
        assert name not in [m.id for m in client.models.list().data]
    finally:  # whatever failed above, the adapter leaves: other tests list every model
        httpx.delete(f"{stack.root_url}/admin/v1/adapters/{name}", headers=admin, timeout=30)