"""loadtests.sweep's config for one value: the top tier's reserve keeps its share; bad values fail fast."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from loadtests.sweep import sweep_config

LOCAL = Path(__file__).resolve().parents[2] / "configs" / "local.yaml"


def _tiny(path: Path) -> dict:
    doc = yaml.safe_load(path.read_text())
    return next(m for m in doc["applications"][0]["args"]["models"] if m["id"] == "tiny-chat")


@pytest.mark.parametrize(("seqs", "reserved"), [(4, 1), (16, 2), (64, 8), (128, 16)])
def test_reserved_slots_keep_their_share_of_max_num_seqs(tmp_path: Path, seqs: int, reserved: int) -> None:
    assert _tiny(LOCAL)["admission"]["reserved_slots"] == 8  # of 64
    path = sweep_config(LOCAL, "tiny-chat", "max_num_seqs", seqs, 8123, tmp_path, only_model=True)
    model = _tiny(path)
    assert model["engine"]["max_num_seqs"] == seqs
    assert model["admission"]["reserved_slots"] == reserved


def test_a_value_the_schema_refuses_stops_the_sweep_before_starting_an_app(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"max_num_seqs=0 makes an invalid config:\n.*max_num_seqs"):
        sweep_config(LOCAL, "tiny-chat", "max_num_seqs", 0, 8123, tmp_path, only_model=True)
