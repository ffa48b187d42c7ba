"""Owner-only checkpoints: make a written tree private, refuse to load one others can change.

Loading a checkpoint unpickles its ``.metadata`` (torch DCP) and reads ``rng_rank<r>.pt``, so
whoever can write those files can run code in the trainer. Checkpoints are therefore written
owner-only (directories 0700, files 0600), and ``check_private`` refuses, before anything is
read, a checkpoint where any path is writable by group or others or owned by another user.
"""

from __future__ import annotations

import os
from pathlib import Path

from relax_hpc.ops.files import PRIVATE_DIR_MODE, PRIVATE_FILE_MODE, unsafe_paths

__all__ = [
    "PRIVATE_DIR_MODE",
    "PRIVATE_FILE_MODE",
    "UnsafeCheckpointError",
    "check_private",
    "make_private_tree",
    "unsafe_paths",
]

_SHOWN = 5  # paths named in an error; the rest are counted


class UnsafeCheckpointError(ValueError):
    """A checkpoint others could have changed; loading it would unpickle their bytes.

    A ValueError, like the other problems a user fixes before re-running (the CLI prints it on
    one line).
    """


def make_private_tree(root: Path) -> None:
    """chmod every directory under ``root`` (itself included) 0700 and every file 0600."""
    for dirpath, _dirnames, filenames in os.walk(root):
        os.chmod(dirpath, PRIVATE_DIR_MODE)
        for name in filenames:
            os.chmod(os.path.join(dirpath, name), PRIVATE_FILE_MODE)


def check_private(root: Path, checkpoint: Path, action: str = "resume from") -> None:
    """Raise UnsafeCheckpointError when ``root``, ``checkpoint`` or anything in it is unsafe.

    ``action``: what was about to happen, for the message ("resume from", "export")."""
    paths = [root, checkpoint, *sorted(checkpoint.rglob("*"))]
    problems = unsafe_paths(paths)
    if not problems:
        return
    shown = "; ".join(problems[:_SHOWN])
    if len(problems) > _SHOWN:
        shown += f"; and {len(problems) - _SHOWN} more"
    owned_elsewhere = any("owned by uid" in p for p in problems)
    resuming = action == "resume from"
    fix = (f"if you trust its content, run `chmod -R go-w {root}`"
           + (" and copy what another user owns (cp -r) so that you own it" if owned_elsewhere else "")
           + (", then resume; otherwise move it aside" if resuming else ", then run it again"))
    raise UnsafeCheckpointError(
        f"refusing to {action} {checkpoint}: loading unpickles its files, and other users can "
        f"change these paths: {shown}. {fix[0].upper()}{fix[1:]}"
        + (" (or start over from step 0: `relax-hpc run --start-over`, or [checkpoint] resume = false)" if resuming else "")
    )
