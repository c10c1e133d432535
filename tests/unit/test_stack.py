"""loadtests.harness.stack, the one stack harness, without Ray: processes are stopped with their whole
tree, configs are copied onto a private port and keys file, keys come from the public command,
and an app that exits during start-up fails fast with its log."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from loadtests.bench import procs as bench_procs
from loadtests.harness import stack as harness
from tests.keys import file_store

LOCAL = Path(__file__).resolve().parents[2] / "configs" / "local.yaml"


def test_stop_kills_descendants_that_left_the_process_group(tmp_path: Path) -> None:
    # The background child moves to a session (and group) of its own, as Ray's actors leave ours.
    proc = harness.spawn("tree", ["sh", "-c", "setsid sleep 60 & exec sleep 60"], tmp_path / "log")
    deadline = time.monotonic() + 10
    while bench_procs.cpu_seconds(proc.pid).keys() != {"sleep"} and time.monotonic() < deadline:
        time.sleep(0.05)  # until both have exec'd sleep
    family = harness.descendants(proc.pid)
    assert len(family) == 1, family
    [child] = family
    assert os.getpgid(child) != os.getpgid(proc.pid)
    assert os.getsid(proc.pid) == os.getsid(0)  # the caller's session (see spawn's docstring)

    harness.stop(proc, timeout_s=5, grace_s=0.5)
    assert not proc.alive()
    assert _gone(child), "the detached child outlived stop()"  # killed, then reaped by init


def _gone(pid: int) -> bool:
    deadline = time.monotonic() + 5
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    stat = Path(f"/proc/{pid}/stat")
    return not stat.exists() or ") Z " in stat.read_text()


def test_wait_until_fails_fast_and_stop_finds_the_orphans(tmp_path: Path) -> None:
    # The parent exits and leaves a detached child behind, as a crashed app leaves Ray's processes.
    proc = harness.spawn("quitter", ["sh", "-c", "setsid sleep 60 & sleep 1.5; echo the reason; exit 3"],
                         tmp_path / "log")
    t0 = time.monotonic()
    with pytest.raises(harness.ProcExited, match=r"(?s)quitter exited with 3 .*the reason"):
        harness.wait_until(lambda: False, [proc], "nothing", timeout_s=60)
    assert time.monotonic() - t0 < 10
    [orphan] = [p for p in proc.family if "sleep" in harness.cmdline(p)]
    assert harness.descendants(proc.pid) == {}  # no longer found from the (dead) root
    harness.stop(proc, grace_s=0.5)
    assert _gone(orphan), "the orphan outlived stop()"


def test_copy_config_uses_a_private_port_and_keys_file(tmp_path: Path) -> None:
    def edit(args: dict[str, Any]) -> None:
        args["gateway"]["http"] = {"max_body_bytes": 4096}

    path = harness.copy_config(LOCAL, tmp_path / "serve.yaml", port=8123,
                               keys_file=tmp_path / "keys.yaml", edit=edit)
    doc = yaml.safe_load(path.read_text())
    assert doc["http_options"]["host"] == "127.0.0.1" and doc["http_options"]["port"] == 8123
    cfg = harness.read_config(path)
    assert cfg.gateway.keys.file == str(tmp_path / "keys.yaml")
    assert cfg.gateway.http.max_body_bytes == 4096
    # Everything else is the source config's.
    assert [m.id for m in cfg.models] == [m.id for m in harness.read_config(LOCAL).models]


def test_copy_config_refuses_an_edit_the_schema_refuses(tmp_path: Path) -> None:
    def edit(args: dict[str, Any]) -> None:
        args["gateway"]["num_replicas"] = 0

    with pytest.raises(harness.ConfigRefused, match=r"args.gateway.num_replicas: .* \(got 0\)"):
        harness.copy_config(LOCAL, tmp_path / "serve.yaml", port=8123,
                            keys_file=tmp_path / "keys.yaml", edit=edit)


def test_keys_create_runs_the_public_command(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys.yaml"
    secret = harness.keys_create(keys_file, "load-1", "batch", ["tiny-chat"])
    record = file_store(keys_file).lookup(secret)
    assert record is not None and record.tier == "batch" and record.models == ("tiny-chat",)
    with pytest.raises(harness.StackError, match="keys create --id load-1 failed"):
        harness.keys_create(keys_file, "load-1", "batch")  # the id is taken


def test_an_app_that_exits_during_start_up_fails_fast_with_its_log(tmp_path: Path) -> None:
    # A keys file the app cannot read stops `serve-app run` before it starts Ray.
    (tmp_path / "keys.yaml").write_text("keys: [not a record]\n")
    t0 = time.monotonic()
    shown = r"(?s)stack \(serve-app run\) exited with 2 .*error: .*keys.yaml:\nkeys.keys.0: "
    with pytest.raises(harness.ProcExited, match=shown):
        harness.start_stack(LOCAL, tmp_path, timeout_s=120, retries=1)
    assert time.monotonic() - t0 < 60
    # It was tried twice, each with its own log, and nothing of it is left running.
    assert (tmp_path / "stack.log").exists() and (tmp_path / "stack-2.log").exists()
