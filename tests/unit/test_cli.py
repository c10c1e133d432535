"""serve_app.cli and what it dispatches to: the stable local demo key, key commands, config checks and engine arguments
(no Ray started)."""

from __future__ import annotations

import json
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from serve_app.cli import main
from serve_app.config import APP_NAME, load_app_config
from serve_app.local.demo_key import DEMO_KEY_ID
from serve_app.local.demo_key import ensure_demo_key as ensure_in
from serve_app.local.stack import LocalStack, app_status
from serve_app.state.keys import FileKeyStore, read_keys_file
from tests.keys import create_key, file_store, revoke_key, run

CONFIG_FILES = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.y*ml"))


@pytest.fixture
def paths(tmp_path: Path) -> tuple[Path, Path]:
    return tmp_path / "keys.yaml", tmp_path / "secret" / "demo-key.secret"


def ensure_demo_key(keys_file: Path, secret_file: Path) -> str:
    """The launcher's demo key in the keys file."""
    return run(ensure_in(FileKeyStore(keys_file), secret_file))


def _demo_records(keys_file: Path) -> list[tuple[str, bool]]:
    return [(k.id, k.revoked) for k in read_keys_file(keys_file).keys if k.id == DEMO_KEY_ID]


def test_demo_key_is_created_and_works(paths: tuple[Path, Path]) -> None:
    keys_file, secret_file = paths
    secret = ensure_demo_key(keys_file, secret_file)
    assert secret_file.read_text().strip() == secret
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
    assert secret not in keys_file.read_text()
    record = file_store(keys_file).lookup(secret)
    assert record is not None and record.id == DEMO_KEY_ID and record.models == ("*",)


def test_demo_key_is_stable_across_runs(paths: tuple[Path, Path]) -> None:
    keys_file, secret_file = paths
    first = ensure_demo_key(keys_file, secret_file)
    assert ensure_demo_key(keys_file, secret_file) == first
    assert _demo_records(keys_file) == [(DEMO_KEY_ID, False)]


def test_revoked_demo_key_is_replaced(paths: tuple[Path, Path]) -> None:
    keys_file, secret_file = paths
    old = ensure_demo_key(keys_file, secret_file)
    revoke_key(keys_file, DEMO_KEY_ID)
    new = ensure_demo_key(keys_file, secret_file)
    assert new != old
    store = file_store(keys_file)
    assert store.lookup(old) is None
    assert store.lookup(new) is not None
    assert _demo_records(keys_file) == [(DEMO_KEY_ID, False)]


def test_lost_secret_file_gives_a_new_key_and_retires_the_old(paths: tuple[Path, Path]) -> None:
    keys_file, secret_file = paths
    old = ensure_demo_key(keys_file, secret_file)
    secret_file.unlink()
    new = ensure_demo_key(keys_file, secret_file)
    assert new != old
    assert file_store(keys_file).lookup(old) is None
    assert _demo_records(keys_file) == [(DEMO_KEY_ID, False)]


def test_other_keys_are_left_alone(paths: tuple[Path, Path]) -> None:
    keys_file, secret_file = paths
    team = create_key(keys_file, "team", "premium", ["tiny-chat"])
    ensure_demo_key(keys_file, secret_file)
    revoke_key(keys_file, DEMO_KEY_ID)
    ensure_demo_key(keys_file, secret_file)
    record = file_store(keys_file).lookup(team)
    assert record is not None and record.tier == "premium"


def test_keys_commands_create_list_revoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    keys_file = str(tmp_path / "keys.yaml")
    assert main(["keys", "--keys-file", keys_file, "create", "--id", "k1", "--models", "tiny"]) == 0
    secret = capsys.readouterr().out.strip().splitlines()[-1]
    assert file_store(Path(keys_file)).lookup(secret) is not None
    assert main(["keys", "--keys-file", keys_file, "list"]) == 0
    listing = capsys.readouterr().out
    assert "k1" in listing and "active" in listing and secret not in listing
    assert main(["keys", "--keys-file", keys_file, "revoke", "--id", "k1"]) == 0
    capsys.readouterr()
    assert file_store(Path(keys_file)).lookup(secret) is None
    # Errors are reported, not raised.
    assert main(["keys", "--keys-file", keys_file, "revoke", "--id", "nope"]) == 2
    assert "no key with id 'nope'" in capsys.readouterr().err


def test_check_config_accepts_shipped_configs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-config", *map(str, CONFIG_FILES)]) == 0
    assert capsys.readouterr().out.count(": ok (") == len(CONFIG_FILES)


def test_check_config_reports_bad_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "applications:\n"
        "  - name: llm\n"
        "    import_path: serve_app.app:build_app\n"
        "    args:\n"
        "      models:\n"
        "        - {id: m, source: x, engine: {max_num_seqs: 0}}\n"
    )
    assert main(["check-config", str(bad)]) == 1
    assert "args.models.0.engine.max_num_seqs" in capsys.readouterr().err


def test_keys_options_may_follow_the_subcommand(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    keys_file = str(tmp_path / "keys.yaml")
    assert main(["keys", "create", "--keys-file", keys_file, "--id", "k1", "--tier", "batch"]) == 0
    secret = capsys.readouterr().out.strip().splitlines()[-1]
    record = file_store(Path(keys_file)).lookup(secret)
    assert record is not None and record.tier == "batch"
    assert main(["keys", "list", "--keys-file", keys_file]) == 0
    assert "k1" in capsys.readouterr().out


def _one_model_config(tmp_path: Path, model: str) -> Path:
    path = tmp_path / "serve.yaml"
    path.write_text(
        "applications:\n"
        "  - name: llm\n"
        "    import_path: serve_app.app:build_app\n"
        "    args:\n"
        f"      models:\n        - {model}\n"
    )
    return path


def test_engine_args_prints_what_the_app_gives_vllm(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    weights = tmp_path / "weights"
    weights.mkdir()
    config = _one_model_config(tmp_path, (
        f"{{id: m, source: {weights}, task: embed, frontend: {{enable_prompt_tokens_details: true}}, "
        "env: {VLLM_CPU_OMP_THREADS_BIND: '1'}, "
        "engine: {max_num_seqs: 8, tensor_parallel_size: 2, extra: {swap_space: 1}}}"))
    assert main(["engine-args", "--config", str(config), "--model", "m"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model_path"] == str(weights)
    kw = out["engine_kwargs"]
    assert kw["model"] == str(weights) and kw["served_model_name"] == ["m"]
    assert kw["max_num_seqs"] == 8 and kw["swap_space"] == 1 and kw["runner"] == "pooling"
    assert kw["distributed_executor_backend"] == "mp"  # TP 2 on the default CPU accelerator
    # Exactly the model's own engine arguments, as JSON.
    expected = load_app_config(config).model("m").engine_kwargs(str(weights))
    assert kw == json.loads(json.dumps(expected))
    assert out["frontend"] == {"enable_prompt_tokens_details": True}
    assert out["env"] == {"VLLM_CPU_OMP_THREADS_BIND": "1"}
    assert out["adapters"] == {}


def test_engine_args_names_the_adapters_folders(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    weights, adapter = tmp_path / "weights", tmp_path / "adapter"
    weights.mkdir()
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8}')
    config = _one_model_config(tmp_path, (
        f"{{id: m, source: {weights}, engine: {{enable_lora: true}}, "
        f"adapters: [{{name: m-lora, source: {adapter}}}]}}"))
    assert main(["engine-args", "--config", str(config), "--model", "m"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["adapters"] == {"m-lora": str(adapter)}  # vLLM's --lora-modules m-lora=<folder>
    assert out["engine_kwargs"]["enable_lora"] is True


def test_engine_args_errors_are_messages(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _one_model_config(tmp_path, "{id: m, source: 'package:no_such_pkg_xyz/model'}")
    assert main(["engine-args", "--config", str(config), "--model", "other"]) == 2
    assert "no model 'other' (have ['m'])" in capsys.readouterr().err
    assert main(["engine-args", "--config", str(config), "--model", "m"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "'no_such_pkg_xyz' is not installed" in captured.err


# ---- serve-app run's parts, without Ray ---------------------------------------------------------
def test_shipped_configs_name_their_app_by_the_one_constant() -> None:
    for path in CONFIG_FILES:
        apps = yaml.safe_load(path.read_text())["applications"]
        assert [a["name"] for a in apps] == [APP_NAME], path


def test_run_stops_before_ray_on_an_unreadable_keys_file(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    keys_file = tmp_path / "keys.yaml"
    keys_file.write_text("keys: [not a record]\n")
    config = CONFIG_FILES[0].parent / "local.yaml"
    assert main(["run", "--config", str(config), "--keys-file", str(keys_file)]) == 2
    captured = capsys.readouterr()
    assert "error: " in captured.err and "starting Ray" not in captured.out


def test_the_stack_takes_host_and_port_from_the_file_unless_given(tmp_path: Path) -> None:
    cfg = load_app_config(CONFIG_FILES[0].parent / "local.yaml")
    stack = LocalStack.from_config(cfg, {"host": "0.0.0.0", "port": 9000})
    assert (stack.host, stack.port) == ("0.0.0.0", 9000)
    assert stack.keys_file == Path(cfg.gateway.keys.file).resolve()
    stack = LocalStack.from_config(cfg, None, host="127.0.0.2", port=9100,
                                   keys_file=str(tmp_path / "k.yaml"))
    assert stack.base_url == "http://127.0.0.2:9100/v1"
    assert stack.keys_file == tmp_path / "k.yaml"
    assert LocalStack.from_config(cfg, None).base_url == "http://127.0.0.1:8000/v1"


def test_app_status_names_each_deployment() -> None:
    def status(app: object | None) -> SimpleNamespace:
        return SimpleNamespace(applications={APP_NAME: app} if app else {})

    def word(value: str) -> SimpleNamespace:
        return SimpleNamespace(value=value)

    assert app_status(status(None)) == ("NOT_STARTED", "")
    app = SimpleNamespace(status=word("DEPLOYING"), deployments={
        "model-b": SimpleNamespace(status=word("UPDATING")),
        "gateway": SimpleNamespace(status=word("HEALTHY"))})
    assert app_status(status(app)) == ("DEPLOYING", "gateway=HEALTHY model-b=UPDATING")


def test_the_tiny_model_builds_in_its_own_process_unless_it_is_built(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import serve_app.engine.tiny_model as tiny
    import serve_app.local.tiny_model as local_tiny

    started: list[list[str]] = []
    monkeypatch.setattr(local_tiny.subprocess, "Popen", lambda argv: started.append(argv) or "proc")
    monkeypatch.setattr(tiny, "is_built", lambda path: True)
    assert local_tiny.start_tiny_model_build(str(tmp_path)) is None
    assert "already built" in capsys.readouterr().out and started == []
    monkeypatch.setattr(tiny, "is_built", lambda path: False)
    assert local_tiny.start_tiny_model_build(str(tmp_path)) == "proc"
    assert started[0][1:] == ["-m", "serve_app.cli", "build-tiny-model", "--cache-dir", str(tmp_path)]


def test_each_stage_of_run_says_its_time_and_the_total(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = load_app_config(CONFIG_FILES[0].parent / "local.yaml")
    stack = LocalStack.from_config(cfg, None)
    stack.stage_done("Ray started")
    stack.stage_done("Ray Serve started")
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["[serve-app] Ray started",
                                                     "[serve-app] Ray Serve started"]
    assert all(line.endswith(" s)") and "(total " in line for line in lines)


def test_build_tiny_lora_builds_one_adapter_per_seed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from serve_app.engine import tiny_lora

    assert main(["build-tiny-lora", "--out", str(tmp_path), "--count", "2", "--seed", "7"]) == 0
    paths = capsys.readouterr().out.split()
    assert paths == [str((tmp_path / "lora-00").resolve()), str((tmp_path / "lora-01").resolve())]
    assert tiny_lora.is_built(Path(paths[0]), 7) and tiny_lora.is_built(Path(paths[1]), 8)
