"""The storage failures of a checkpoint save, in a module of their own: the driver tells them
apart from other failures (relax_hpc/driver/checkpointing.py) without loading torch's DCP, which
only the processes that save or load a checkpoint need (relax_hpc/ckpt/manager.py)."""

from __future__ import annotations

import errno

__all__ = ["DISK_FULL_ERRNOS", "STORAGE_ERRNOS", "CheckpointDiskFullError", "CheckpointSaveError",
           "NoUsableCheckpointError"]

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# Failures of the storage a save writes to. They say nothing about the trainer, whose model and
# optimizer a save only reads, so a later save on the same filesystem may well succeed.
STORAGE_ERRNOS = (*DISK_FULL_ERRNOS, errno.EIO, errno.EROFS, errno.ESTALE)


class CheckpointSaveError(RuntimeError):
    """A save failed on its storage; its temporary directory has been removed and the complete
    checkpoints (and ``latest``) are untouched. ``filesystem``: the mount point holding the root."""

    def __init__(self, message: str, filesystem: str = "") -> None:
        super().__init__(message)
        self.filesystem = filesystem  # pickled with the exception (Ray hands it to the driver)


class CheckpointDiskFullError(CheckpointSaveError):
    """A save ran out of disk space (or quota); its temporary directory has been removed."""


class NoUsableCheckpointError(ValueError):
    """Complete checkpoints exist but none loaded (a missing file, a stale NFS handle): the run
    stops instead of starting over from step 0. A ValueError: the CLI prints it on one line, and
    the message names each checkpoint, why it did not load, and the two ways out."""
