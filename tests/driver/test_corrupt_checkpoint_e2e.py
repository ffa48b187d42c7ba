"""A run whose newest checkpoint is damaged resumes from the one before, says so, and trains
every sample exactly once (the loader's own fallback is tested in tests/ckpt/test_ckpt_manager.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest
from ckpt_fault_helpers import (
    assert_every_sample_trained_once,
    assert_latest_is_complete,
    tiny_local_copy,
)

from relax_hpc.driver.run import run_job
from relax_hpc.spec import parse_spec

LOADER = "relax_hpc.ckpt.manager"


def truncate_a_shard(checkpoint: Path) -> str:
    """A copy cut short (a full disk while it was copied, a node lost while it was synced)."""
    shard = next(checkpoint.glob("*.distcp"))
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    return f"{shard} is truncated"


def garbage_in_metadata(checkpoint: Path) -> str:
    """An index overwritten by something else (a bad block, a stray write)."""
    (checkpoint / ".metadata").write_bytes(b"\x00garbage" * 64)
    return f"{checkpoint / '.metadata'} cannot be read"


@pytest.mark.parametrize("damage", [truncate_a_shard, garbage_in_metadata], ids=lambda f: f.__name__)
def test_a_damaged_newest_checkpoint_resumes_from_the_previous_one(
        tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture,
        damage: Callable[[Path], str]) -> None:
    job = tmp_path / "job"
    checkpoints = job / "checkpoints"
    first = run_job(parse_spec(tiny_local_copy(tiny_model_dir, job, steps=4)), in_process=True, progress=False)
    assert first.result.end_step == 4
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_3", "step_4"]
    why = damage(checkpoints / "step_4")

    with caplog.at_level(logging.WARNING, logger=LOADER):
        resumed = run_job(parse_spec(tiny_local_copy(tiny_model_dir, job, steps=6)), in_process=True,
                          progress=False)

    warnings = [r.getMessage() for r in caplog.records if r.name == LOADER and r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f"checkpoint {checkpoints / 'step_4'} is unusable (rank 0: ")
    assert why in warnings[0] and "trying the previous one" in warnings[0]
    assert (resumed.result.start_step, resumed.result.end_step) == (3, 6)
    assert_latest_is_complete(checkpoints, 6)
    assert_every_sample_trained_once(job, steps=6)  # the 4th step trained twice, archived once
