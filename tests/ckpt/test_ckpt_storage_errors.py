"""A save that fails on its storage (not only a full disk) raises CheckpointSaveError, which
names the filesystem, after removing its unfinished directory; the loop survives exactly these
(relax_hpc/driver/checkpointing.py)."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch.distributed.checkpoint.filesystem as dcp_filesystem
from ckpt_helpers import resume_state, train

from relax_hpc.ckpt import CheckpointDiskFullError, CheckpointManager
from relax_hpc.ckpt.manager import CheckpointSaveError, mount_point, storage_error_cause


def save_failing_in_dcp(root: Path, monkeypatch: pytest.MonkeyPatch, error: OSError) -> BaseException:
    """Save steps 1 and 2 under `root`, step 2's DCP data write failing with `error`; the error."""
    first = train(1)
    CheckpointManager(root).save(1, first.model, first.optimizer, resume_state(1))
    real = dcp_filesystem.FileSystem.create_stream

    @contextmanager
    def create_stream(self: Any, path: Any, open_mode: str) -> Iterator[Any]:
        with real(self, path, open_mode) as stream:
            if "w" in open_mode:
                raise error
            yield stream

    monkeypatch.setattr(dcp_filesystem.FileSystem, "create_stream", create_stream)
    later = train(2, seed=2)
    with pytest.raises(CheckpointSaveError) as info:
        CheckpointManager(root).save(2, later.model, later.optimizer, resume_state(2))
    monkeypatch.undo()
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_1"]  # tmp_step_2 removed
    assert (root / "latest").read_text() == "step_1\n"
    return info.value


def test_an_io_error_names_the_filesystem_and_is_not_called_a_full_disk(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "ckpt"
    error = save_failing_in_dcp(root, monkeypatch, OSError(errno.EIO, os.strerror(errno.EIO)))
    assert not isinstance(error, CheckpointDiskFullError)
    assert error.filesystem == str(mount_point(root))  # type: ignore[attr-defined]
    message = str(error)
    assert message.startswith(f"saving checkpoint step_2 failed on the filesystem holding {root} "
                              f"(mounted at {mount_point(root)}): ")
    assert "Input/output error" in message and "untouched (newest: step_1)" in message


def test_a_full_disk_is_a_storage_error_naming_where_to_free_space(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "ckpt"
    error = save_failing_in_dcp(root, monkeypatch, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    assert isinstance(error, CheckpointDiskFullError)
    assert f"Free space on {mount_point(root)} (df -h {root})" in str(error)


def test_storage_causes_and_mount_points() -> None:
    assert storage_error_cause(RuntimeError("rank 1: OSError: [Errno 5] Input/output error")) is not None
    assert storage_error_cause(OSError(errno.ESTALE, os.strerror(errno.ESTALE))) is not None
    assert storage_error_cause(TimeoutError("rank 1 did not answer")) is None
    assert storage_error_cause(OSError(errno.ECONNRESET, os.strerror(errno.ECONNRESET))) is None
    assert mount_point(Path("/")) == Path("/")
    assert mount_point(Path("/proc/self/does/not/exist")) == Path("/proc")
