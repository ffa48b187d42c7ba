"""Pure layout rules: names, load order, prune plans, resume.json validation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relax_hpc.ckpt.layout import list_root, load_order, parse_latest, plan_prune
from relax_hpc.ckpt.resume_state import ResumeState, read_resume_file, write_resume_file


def test_parse_latest_accepts_only_step_names() -> None:
    assert parse_latest("step_12\n") == 12
    assert parse_latest("step_x") is None
    assert parse_latest("tmp_step_3") is None
    assert parse_latest("") is None


def test_load_order_puts_pointer_first_then_newest() -> None:
    assert load_order(None, [1, 5, 3]) == [5, 3, 1]
    assert load_order(3, [1, 5, 3]) == [3, 5, 1]
    # A pointer at a directory that is gone is ignored.
    assert load_order(9, [1, 5, 3]) == [5, 3, 1]


def test_plan_prune_keeps_just_saved_and_newest_older() -> None:
    assert plan_prune(6, [2, 4, 6], keep_last=2).delete == (2,)
    assert plan_prune(6, [2, 4, 6], keep_last=1).delete == (2, 4)
    assert plan_prune(6, [2, 4, 6], keep_last=5).delete == ()
    # Newer steps from a rolled-back run are kept and reported, never counted.
    plan = plan_prune(3, [1, 2, 3, 8, 9], keep_last=2)
    assert plan.delete == (1,)
    assert plan.newer_kept == (8, 9)
    with pytest.raises(ValueError, match="keep_last=0"):
        plan_prune(3, [3], keep_last=0)


def test_list_root_separates_complete_and_tmp(tmp_path: Path) -> None:
    for name in ("step_2", "step_10", "tmp_step_11", "other"):
        (tmp_path / name).mkdir()
    (tmp_path / "step_3").write_text("a file, not a checkpoint")
    listing = list_root(tmp_path)
    assert listing.steps == (2, 10)
    assert listing.tmp_dirs == ("tmp_step_11",)
    assert list_root(tmp_path / "missing").steps == ()


def test_resume_file_round_trip_and_errors(tmp_path: Path) -> None:
    state = ResumeState(
        step=4, weight_version=5, data_cursor={"index": 3}, samples_trained=32, extra={"a": [1]}
    )
    write_resume_file(tmp_path, state, world_size=2)
    loaded = read_resume_file(tmp_path)
    assert loaded.state == state and loaded.world_size == 2

    payload = json.loads((tmp_path / "resume.json").read_text())
    payload["resume_state"]["step"] = "4"
    payload["resume_state"]["bogus"] = 1
    (tmp_path / "resume.json").write_text(json.dumps(payload))
    with pytest.raises(ValueError, match=r"step='4' must be an integer.*unknown keys \['bogus'\]"):
        read_resume_file(tmp_path)

    (tmp_path / "resume.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        read_resume_file(tmp_path)


def test_resume_state_rejects_non_json_values() -> None:
    import torch

    with pytest.raises(ValueError, match="not JSON-serialisable"):
        ResumeState(step=1, weight_version=1, data_cursor={"t": torch.zeros(1)}, samples_trained=0).to_dict()
