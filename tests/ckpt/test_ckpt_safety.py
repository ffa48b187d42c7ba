"""Checkpoint safety: owner-only modes, the refusal to resume from a checkpoint others can
change, and a full disk during a save (the unfinished directory goes, the previous one stays)."""

from __future__ import annotations

import errno
import io
import os
import stat
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint.filesystem as dcp_filesystem

from ckpt_helpers import Trained, assert_same_training_state, fresh, resume_state, train
from relax_hpc.ckpt import CheckpointDiskFullError, CheckpointManager, UnsafeCheckpointError
from relax_hpc.ckpt.manager import disk_full_cause


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@contextmanager
def umask(value: int) -> Iterator[None]:
    old = os.umask(value)
    try:
        yield
    finally:
        os.umask(old)


def saved(root: Path, steps: list[int]) -> dict[int, Trained]:
    mgr = CheckpointManager(root)
    out = {}
    for step in steps:
        out[step] = train(step, seed=step)
        mgr.save(step, out[step].model, out[step].optimizer, resume_state(step))
    return out


def test_checkpoints_are_owner_only_even_under_a_group_umask(tmp_path: Path) -> None:
    # Clusters often run with umask 002 (group-shared projects); checkpoints stay private.
    with umask(0o002):
        saved(tmp_path / "ckpt", [1])
    root = tmp_path / "ckpt"
    assert mode(root) == 0o700
    assert mode(root / "latest") == 0o600
    assert mode(root / "step_1") == 0o700
    files = [p for p in (root / "step_1").rglob("*")]
    assert {".metadata", "resume.json", "rng_rank0.pt"} <= {p.name for p in files}
    assert {p.name: mode(p) for p in files} == {p.name: 0o600 for p in files}


def test_existing_root_keeps_its_mode(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    root.mkdir(mode=0o755)
    saved(root, [1])
    assert mode(root) == 0o755  # not widened or narrowed; still loadable (not writable by others)
    dst = fresh()
    assert CheckpointManager(root).load_latest(dst.model, dst.optimizer) == resume_state(1)


@pytest.mark.parametrize("target", [".metadata", "step_1", "resume.json", "."])
def test_resume_refuses_a_checkpoint_writable_by_others(tmp_path: Path, target: str) -> None:
    root = tmp_path / "ckpt"
    src = saved(root, [1])[1]
    unsafe = root / target if target in ("step_1", ".") else root / "step_1" / target
    unsafe.chmod(0o770 if unsafe.is_dir() else 0o662)
    dst = fresh()
    before = [p.detach().clone() for p in dst.model.parameters()]

    with pytest.raises(UnsafeCheckpointError) as info:
        CheckpointManager(root).load_latest(dst.model, dst.optimizer)

    message = str(info.value)
    expected = "0770: writable by group" if unsafe.is_dir() else "0662: writable by group and others"
    assert f"{unsafe} (mode {expected})" in message
    assert f"refusing to resume from {root / 'step_1'}" in message
    assert f"chmod -R go-w {root}" in message
    # Nothing of it was loaded.
    assert all(torch.equal(a, b) for a, b in zip(before, dst.model.parameters(), strict=True))

    subprocess.run(["chmod", "-R", "go-w", str(root)], check=True)  # the fix the message gives
    assert CheckpointManager(root).load_latest(dst.model, dst.optimizer) == resume_state(1)
    assert_same_training_state(src, dst)


def test_resume_refuses_before_falling_back_to_an_unsafe_older_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    saved(root, [1, 2])
    (root / "step_2" / ".metadata").unlink()  # the newest is damaged: load_latest falls back
    (root / "step_1" / "rng_rank0.pt").chmod(0o622)
    dst = fresh()
    with pytest.raises(UnsafeCheckpointError, match=r"step_1/rng_rank0.pt \(mode 0622"):
        CheckpointManager(root).load_latest(dst.model, dst.optimizer)


def test_resume_refuses_files_owned_by_another_user(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "ckpt"
    saved(root, [1])
    metadata = root / "step_1" / ".metadata"
    if os.geteuid() == 0:
        os.chown(metadata, 4242, -1)  # root, too, must not unpickle another user's file
        owner, me = 4242, 0
    else:
        owner, me = os.geteuid(), os.geteuid() + 1
        monkeypatch.setattr(os, "geteuid", lambda: me)
    dst = fresh()
    with pytest.raises(UnsafeCheckpointError, match=rf"\.metadata \(owned by uid {owner}; you are uid {me}\)"):
        CheckpointManager(root).load_latest(dst.model, dst.optimizer)


class _FullDisk(io.RawIOBase):
    """A DCP output stream on a disk that is full: every write fails with ENOSPC."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return 0

    def write(self, _data: Any) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))


def assert_previous_checkpoint_intact(root: Path, previous: Trained) -> None:
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_1"]
    assert (root / "latest").read_text() == "step_1\n"
    dst = fresh()
    assert CheckpointManager(root).load_latest(dst.model, dst.optimizer) == resume_state(1)
    assert_same_training_state(previous, dst)


def test_full_disk_in_the_dcp_write_removes_tmp_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "ckpt"
    previous = saved(root, [1])[1]
    real = dcp_filesystem.FileSystem.create_stream

    @contextmanager
    def create_stream(self: Any, path: Any, open_mode: str) -> Iterator[Any]:
        with real(self, path, open_mode) as stream:  # the file is created, then the disk is full
            yield _FullDisk(Path(path)) if "w" in open_mode else stream

    monkeypatch.setattr(dcp_filesystem.FileSystem, "create_stream", create_stream)
    later = train(2, seed=2)
    with pytest.raises(CheckpointDiskFullError) as info:
        CheckpointManager(root).save(2, later.model, later.optimizer, resume_state(2))
    monkeypatch.undo()

    message = str(info.value)
    assert f"the disk holding {root} is full" in message
    assert f"No space left on device: '{root / 'tmp_step_2'}/" in message
    assert f"The unfinished {root / 'tmp_step_2'} was removed" in message and "newest: step_1" in message
    assert not (root / "tmp_step_2").exists()
    assert_previous_checkpoint_intact(root, previous)


def test_full_disk_writing_resume_json_removes_tmp_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "ckpt"
    previous = saved(root, [1])[1]
    later = train(2, seed=2)
    real_write = os.write
    target = {"resume.json"}

    def write(fd: int, data: Any) -> int:  # the lowest-level write of relax_hpc.ckpt.fs
        if any(name in os.readlink(f"/proc/self/fd/{fd}") for name in target):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)
    with pytest.raises(CheckpointDiskFullError, match=r"the disk holding .* is full .*No space left on device"):
        CheckpointManager(root).save(2, later.model, later.optimizer, resume_state(2))
    monkeypatch.undo()

    assert not (root / "tmp_step_2").exists()
    assert not list(root.rglob(".*.tmp*"))  # nor a half-written temp file
    assert_previous_checkpoint_intact(root, previous)


def test_other_save_failures_also_remove_tmp_and_keep_their_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "ckpt"
    previous = saved(root, [1])[1]

    def broken(*_args: object) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr("relax_hpc.ckpt.manager._write_rng", broken)
    later = train(2, seed=2)
    with pytest.raises(RuntimeError, match="writing RNG state .* Input/output error") as info:
        CheckpointManager(root).save(2, later.model, later.optimizer, resume_state(2))
    monkeypatch.undo()
    assert not isinstance(info.value, CheckpointDiskFullError)
    assert not (root / "tmp_step_2").exists()
    assert_previous_checkpoint_intact(root, previous)


def test_disk_full_cause_finds_it_through_causes_and_peer_text() -> None:
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/x/tmp_step_3/__1_0.distcp")
    wrapped = RuntimeError("publishing /x/step_3 failed")
    wrapped.__cause__ = full
    assert disk_full_cause(wrapped) == str(full)
    # Another rank's failure arrives as text only.
    peer = RuntimeError("writing RNG state into /x failed: rank 1: OSError: [Errno 122] "
                        f"{os.strerror(errno.EDQUOT)}")
    assert disk_full_cause(peer) == str(peer)
    assert disk_full_cause(RuntimeError("rank 0: OSError: [Errno 5] Input/output error")) is None
