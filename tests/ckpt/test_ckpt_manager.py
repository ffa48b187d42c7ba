"""CheckpointManager in one process: round trip, pruning, crashes and corruption fallback."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ckpt_helpers import Trained, assert_same_training_state, fresh, resume_state, rng_draws, train
from relax_hpc.ckpt import CheckpointManager, capture_rng_state, restore_rng_state
from relax_hpc.ckpt import manager as manager_module

WARN = "relax_hpc.ckpt.manager"


def save_steps(mgr: CheckpointManager, steps: list[int]) -> dict[int, Trained]:
    """Save one checkpoint per step from differently trained models; returns them by step."""
    saved: dict[int, Trained] = {}
    for step in steps:
        trained = train(step, seed=step)
        mgr.save(step, trained.model, trained.optimizer, resume_state(step))
        saved[step] = trained
    return saved


def test_round_trip_restores_everything(tmp_path: Path) -> None:
    src = train(steps=3)
    mgr = CheckpointManager(tmp_path / "ckpt")
    path = mgr.save(3, src.model, src.optimizer, resume_state(3))
    expected_draws = rng_draws()  # what the RNGs produce right after the save

    assert path == tmp_path / "ckpt" / "step_3"
    names = {p.name for p in path.iterdir()}
    assert {".metadata", "resume.json", "rng_rank0.pt"} <= names and any(n.endswith(".distcp") for n in names)
    assert (tmp_path / "ckpt" / "latest").read_text() == "step_3\n"
    assert mgr.list_complete() == [3]

    rng_draws()  # move every RNG away from the saved state
    dst = fresh()
    assert not torch.equal(next(dst.model.parameters()), next(src.model.parameters()))
    state = CheckpointManager(tmp_path / "ckpt").load_latest(dst.model, dst.optimizer)

    assert state == resume_state(3)
    assert_same_training_state(src, dst)
    assert rng_draws() == expected_draws


def test_training_continues_identically_after_resume(tmp_path: Path) -> None:
    reference = train(steps=2)
    mgr = CheckpointManager(tmp_path)
    mgr.save(2, reference.model, reference.optimizer, resume_state(2))
    resumed = fresh()
    mgr.load_latest(resumed.model, resumed.optimizer)
    for run in (reference, resumed):
        run.optimizer.zero_grad()
        run.model(torch.ones(2, 4)).sum().backward()
        run.optimizer.step()
    assert_same_training_state(reference, resumed)


def test_rng_capture_restore_covers_torch_numpy_python() -> None:
    state = capture_rng_state()
    first = rng_draws()
    restore_rng_state(state)
    assert rng_draws() == first
    with pytest.raises(ValueError, match=r"missing \['numpy'\]"):
        restore_rng_state({"torch": state["torch"], "python": state["python"]})


def test_keep_last_prunes_oldest(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=2)
    save_steps(mgr, [1, 2, 3, 4])
    assert mgr.list_complete() == [3, 4]
    assert not (tmp_path / "step_1").exists() and not (tmp_path / "step_2").exists()
    with pytest.raises(ValueError, match="keep_last=0 must be >= 1"):
        CheckpointManager(tmp_path, keep_last=0)


def test_saving_same_step_twice_replaces_it(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path)
    save_steps(mgr, [2])
    newer = train(5, seed=7)
    mgr.save(2, newer.model, newer.optimizer, resume_state(2))
    dst = fresh()
    mgr.load_latest(dst.model, dst.optimizer)
    assert_same_training_state(newer, dst)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_2"]


def test_crash_mid_save_leaves_only_tmp_which_is_ignored_then_cleaned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mgr = CheckpointManager(tmp_path)
    saved = save_steps(mgr, [1])

    def die(*_args: object) -> None:
        # KeyboardInterrupt, not an error: a save that fails removes its tmp_ directory
        # (test_ckpt_safety.py), so the process must stop dead here, as when it is killed.
        raise KeyboardInterrupt

    monkeypatch.setattr(manager_module, "_write_rng", die)
    crashed = train(2, seed=2)
    with pytest.raises(KeyboardInterrupt):
        mgr.save(2, crashed.model, crashed.optimizer, resume_state(2))
    monkeypatch.undo()
    assert (tmp_path / "tmp_step_2" / ".metadata").exists()
    assert mgr.list_complete() == [1]
    assert (tmp_path / "latest").read_text() == "step_1\n"

    dst = fresh()
    assert mgr.load_latest(dst.model, dst.optimizer) == resume_state(1)
    assert_same_training_state(saved[1], dst)

    save_steps(mgr, [3])
    assert not (tmp_path / "tmp_step_2").exists()
    assert mgr.list_complete() == [1, 3]


def test_save_rejects_mismatched_step_and_bad_state(tmp_path: Path) -> None:
    src = train(1)
    mgr = CheckpointManager(tmp_path)
    with pytest.raises(ValueError, match=r"ResumeState.step=1 differs from save\(step=2\)"):
        mgr.save(2, src.model, src.optimizer, resume_state(1))
    bad = resume_state(1)
    bad.extra["tensor"] = torch.ones(1)
    with pytest.raises(ValueError, match="not JSON-serialisable"):
        mgr.save(1, src.model, src.optimizer, bad)
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def _truncate_distcp(path: Path) -> None:
    shard = next(path.glob("*.distcp"))
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)


def _delete_metadata(path: Path) -> None:
    (path / ".metadata").unlink()


def _garbage_resume_json(path: Path) -> None:
    (path / "resume.json").write_text('{"format": 1, "world_si')


def _delete_rng(path: Path) -> None:
    (path / "rng_rank0.pt").unlink()


@pytest.mark.parametrize(
    "damage",
    [_truncate_distcp, _delete_metadata, _garbage_resume_json, _delete_rng],
    ids=lambda f: f.__name__,
)
def test_corrupt_newest_falls_back_to_previous(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: Callable[[Path], None]
) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=3)
    saved = save_steps(mgr, [1, 2])
    damage(tmp_path / "step_2")
    dst = fresh()
    with caplog.at_level(logging.WARNING, logger=WARN):
        state = mgr.load_latest(dst.model, dst.optimizer)

    assert state == resume_state(1)
    assert_same_training_state(saved[1], dst)
    warning = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert str(tmp_path / "step_2") in warning and "NOT deleted" in warning
    assert (tmp_path / "step_2").exists()  # never deleted by load


def test_bytes_damaged_inside_shard_fall_back_after_dcp_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=3)
    saved = save_steps(mgr, [1, 2])
    shard = next((tmp_path / "step_2").glob("*.distcp"))
    size = shard.stat().st_size
    with open(shard, "r+b") as f:  # same size, so only DCP's own load can notice
        f.write(b"\xff" * size)
    dst = fresh()
    with caplog.at_level(logging.WARNING, logger=WARN):
        assert mgr.load_latest(dst.model, dst.optimizer) == resume_state(1)
    assert_same_training_state(saved[1], dst)
    assert "DCP failed" in caplog.text


def test_only_checkpoint_damaged_inside_dcp_raises(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path)
    save_steps(mgr, [1])
    shard = next((tmp_path / "step_1").glob("*.distcp"))
    shard.write_bytes(b"\xff" * shard.stat().st_size)
    dst = fresh()
    with pytest.raises(RuntimeError, match="may be partly overwritten"):
        mgr.load_latest(dst.model, dst.optimizer)


def test_nothing_usable_raises_and_keeps_the_checkpoints(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=3)
    save_steps(mgr, [1, 2])
    _delete_metadata(tmp_path / "step_1")
    _garbage_resume_json(tmp_path / "step_2")
    dst = fresh()
    before = [p.detach().clone() for p in dst.model.parameters()]
    with caplog.at_level(logging.WARNING, logger=WARN), pytest.raises(ValueError, match="none of the complete"):
        mgr.load_latest(dst.model, dst.optimizer)
    assert "is unusable" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(before, dst.model.parameters(), strict=True))
    assert mgr.list_complete() == [1, 2]


def test_empty_or_missing_root_returns_none_silently(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    dst = fresh()
    with caplog.at_level(logging.WARNING, logger=WARN):
        assert CheckpointManager(tmp_path / "nope").load_latest(dst.model, dst.optimizer) is None
        (tmp_path / "tmp_step_4").mkdir()
        assert CheckpointManager(tmp_path).load_latest(dst.model, dst.optimizer) is None
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_latest_pointing_at_deleted_dir_scans(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=3)
    saved = save_steps(mgr, [1, 2, 3])
    manager_module.remove_tree(tmp_path / "step_3")
    dst = fresh()
    with caplog.at_level(logging.WARNING, logger=WARN):
        assert mgr.load_latest(dst.model, dst.optimizer) == resume_state(2)
    assert_same_training_state(saved[2], dst)
    assert "names step_3, which does not exist" in caplog.text


def test_latest_pointer_wins_over_newer_dir(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=3)
    saved = save_steps(mgr, [1, 2])
    (tmp_path / "latest").write_text("step_1\n")  # a user rolling back by hand
    dst = fresh()
    assert mgr.load_latest(dst.model, dst.optimizer) == resume_state(1)
    assert_same_training_state(saved[1], dst)


def test_checkpoint_files_are_not_left_writable_half_way(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path)
    save_steps(mgr, [1])
    # No stray write-then-rename temp files survive a successful save.
    leftovers = [p for p in tmp_path.rglob(".*.tmp*")]
    assert leftovers == []
    payload = json.loads((tmp_path / "step_1" / "resume.json").read_text())
    assert payload["world_size"] == 1 and payload["resume_state"]["step"] == 1
    assert os.access(tmp_path / "latest", os.R_OK)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none visible)")
def test_round_trip_on_cuda_restores_cuda_rng(tmp_path: Path) -> None:
    src = train(steps=2)
    src.model.cuda()
    src.optimizer = torch.optim.AdamW(src.model.parameters(), lr=1e-2)
    src.optimizer.zero_grad()
    src.model(torch.randn(3, 4, device="cuda")).sum().backward()
    src.optimizer.step()
    mgr = CheckpointManager(tmp_path)
    mgr.save(3, src.model, src.optimizer, resume_state(3))
    expected = torch.rand(4, device="cuda").tolist()

    torch.rand(8, device="cuda")
    dst = fresh()
    dst.model.cuda()
    dst.optimizer = torch.optim.AdamW(dst.model.parameters(), lr=5e-3)
    assert mgr.load_latest(dst.model, dst.optimizer) == resume_state(3)
    assert_same_training_state(src, dst)
    assert torch.rand(4, device="cuda").tolist() == expected


def test_save_with_and_load_latest_with_use_the_backends_reader_and_fall_back(tmp_path: Path) -> None:
    # A backend with its own DCP format (the Megatron backend's dist_checkpointing) hands the
    # manager a writer and a reader; the layout, latest pointer and fallback stay the manager's.
    import torch.distributed.checkpoint as dcp

    mgr = CheckpointManager(tmp_path / "ckpt")
    for step in (1, 2):
        with manager_module.single_process_quiet():
            mgr.save_with(step, resume_state(step),
                          lambda d, coll, step=step: dcp.save({"w": torch.full((2,), float(step))},
                                                              checkpoint_id=d, no_dist=True))
    assert (tmp_path / "ckpt" / "latest").read_text() == "step_2\n"
    read: list[str] = []

    def reader(directory: Path, coll: object) -> None:
        read.append(directory.name)
        if directory.name == "step_2":
            raise ValueError("not this one")  # e.g. written by another backend

    state = mgr.load_latest_with(reader)
    assert state is not None and state.step == 1  # step_2 failed: the previous one
    assert read == ["step_2", "step_1"]
    assert (tmp_path / "ckpt" / "step_2").is_dir()  # never deleted


def test_every_public_name_of_the_package_loads() -> None:
    # relax_hpc.ckpt loads its names on first use (the command line must not import torch): each
    # name it lists must come from the module its table names.
    import relax_hpc.ckpt as ckpt

    assert ckpt.__all__ and all(getattr(ckpt, name).__name__ == name for name in ckpt.__all__)
