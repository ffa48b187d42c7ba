"""A resume never silently starts over: complete checkpoints that all fail to load stop the run,
`latest` never moves below a newer complete step it names, and a crash between the two renames of
a second save of one step leaves the old copy where the next load finds it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ckpt_helpers import fresh, resume_state, train
from relax_hpc.ckpt import CheckpointManager
from relax_hpc.ckpt.errors import NoUsableCheckpointError
from relax_hpc.cli.main import build_parser


def _save(mgr: CheckpointManager, step: int) -> None:
    trained = train(step, seed=step)
    mgr.save(step, trained.model, trained.optimizer, resume_state(step))


def test_checkpoints_that_all_fail_to_load_stop_the_run(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=3)
    for step in (1, 2):
        _save(mgr, step)
    for step in (1, 2):
        (tmp_path / f"step_{step}" / "resume.json").unlink()  # as a transient NFS failure shows
    dst = fresh()
    with pytest.raises(NoUsableCheckpointError) as caught:
        mgr.load_latest(dst.model, dst.optimizer)
    text = str(caught.value)
    assert "step_2: rank 0: FileNotFoundError" in text and "step_1: rank 0" in text
    assert "--start-over" in text and "[checkpoint] resume = false" in text and "\n" not in text
    assert build_parser().parse_args(["run", "x.toml", "--start-over"]).start_over is True


def test_latest_is_not_moved_below_a_newer_step_that_did_not_load(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=5)
    for step in (1, 3):
        _save(mgr, step)
    resume_json = tmp_path / "step_3" / "resume.json"
    kept = resume_json.read_bytes()
    resume_json.unlink()  # step_3 fails once; step_1 loads
    resumed = CheckpointManager(tmp_path, keep_last=5)
    dst = fresh()
    assert resumed.load_latest(dst.model, dst.optimizer) == resume_state(1)
    _save(resumed, 2)
    assert (tmp_path / "latest").read_text() == "step_3\n" and (tmp_path / "step_3").is_dir()
    resume_json.write_bytes(kept)  # the cause passed: the next resume gets the real progress
    assert CheckpointManager(tmp_path).load_latest(dst.model, dst.optimizer) == resume_state(3)


def test_rolled_back_latest_still_moves_with_its_saves(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=5)
    for step in (1, 3):
        _save(mgr, step)
    (tmp_path / "latest").write_text("step_1\n")  # a user rolling back by hand
    resumed = CheckpointManager(tmp_path, keep_last=5)
    dst = fresh()
    assert resumed.load_latest(dst.model, dst.optimizer) == resume_state(1)
    _save(resumed, 2)
    assert (tmp_path / "latest").read_text() == "step_2\n"


def test_crash_between_the_renames_of_a_second_save_keeps_the_old_copy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=2)
    _save(mgr, 2)
    real_rename = os.rename

    def crash_on_second_rename(src: os.PathLike[str] | str, dst: os.PathLike[str] | str) -> None:
        if Path(src).name == "tmp_step_2":
            raise KeyboardInterrupt("killed between the renames")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", crash_on_second_rename)
    with pytest.raises(KeyboardInterrupt):
        _save(mgr, 2)
    monkeypatch.setattr(os, "rename", real_rename)
    assert not (tmp_path / "step_2").exists()
    assert not any(p.name.startswith("tmp_") and p.name != "tmp_step_2" for p in tmp_path.iterdir())
    dst = fresh()
    assert CheckpointManager(tmp_path).load_latest(dst.model, dst.optimizer) == resume_state(2)
    _save(CheckpointManager(tmp_path), 3)  # the next prune keeps what was restored
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["step_2", "step_3"]
