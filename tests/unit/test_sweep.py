"""loadtests.sweep's config for one value: the top tier's reserve keeps its share; bad values fail fast."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from loadtests.harness import stack as harness
from loadtests.sweep import apply_value, main

LOCAL = Path(__file__).resolve().parents[2] / "configs" / "local.yaml"


def _tiny(path: Path) -> dict[str, Any]:
    doc = yaml.safe_load(path.read_text())
    return next(m for m in doc["applications"][0]["args"]["models"] if m["id"] == "tiny-chat")


def _copy(tmp_path: Path, param: str, value: Any) -> Path:
    return harness.copy_config(LOCAL, tmp_path / "serve.yaml", port=8123, keys_file=tmp_path / "k.yaml",
                               edit=apply_value("tiny-chat", param, value, only_model=True))


@pytest.mark.parametrize(("seqs", "reserved"), [(4, 1), (16, 2), (64, 8), (128, 16)])
def test_reserved_slots_keep_their_share_of_max_num_seqs(tmp_path: Path, seqs: int, reserved: int) -> None:
    assert _tiny(LOCAL)["admission"]["reserved_slots"] == 8  # of 64
    model = _tiny(_copy(tmp_path, "max_num_seqs", seqs))
    assert model["engine"]["max_num_seqs"] == seqs
    assert model["admission"]["reserved_slots"] == reserved


def test_only_the_swept_model_is_kept(tmp_path: Path) -> None:
    args = yaml.safe_load(_copy(tmp_path, "deployment.max_ongoing_requests", 7).read_text())
    args = args["applications"][0]["args"]
    assert [m["id"] for m in args["models"]] == ["tiny-chat"]
    assert args["models"][0]["deployment"]["max_ongoing_requests"] == 7


def test_a_value_the_schema_refuses_stops_the_sweep_before_starting_an_app(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"max_num_seqs=0 makes an invalid config:\n.*max_num_seqs"):
        main(["--param", "max_num_seqs=0", "--results-dir", str(tmp_path)])
    assert not (tmp_path / "max_num_seqs-0" / "stack.log").exists()  # no app was started
