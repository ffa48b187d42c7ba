"""Durable, owner-only file helpers for checkpoints and job files: write-then-rename and fsync.

A checkpoint must never look complete unless every byte of it is on disk. These
helpers write to a temporary sibling, fsync the file, rename it over the target and
fsync the parent directory, so a crash leaves either the old file or the new one.
Files are created 0600 (``PRIVATE_FILE_MODE``; the umask can only narrow it), and the
process umask is left alone: other threads may be creating files at the same time.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from relax_hpc.ckpt.permissions import PRIVATE_FILE_MODE

__all__ = ["atomic_write_bytes", "atomic_write_text", "fsync_dir", "fsync_tree", "remove_tree", "write_all"]


def fsync_dir(path: Path) -> None:
    """Flush a directory entry table, so renames and creations inside it survive a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so readers see either the old content or all of the new."""
    # A fresh name, created O_EXCL (mkstemp): two writers never share a temp file, and a name
    # planted beforehand (a symbolic link to a file of ours) is never opened.
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    tmp = Path(tmp_name)
    try:
        try:
            os.fchmod(fd, PRIVATE_FILE_MODE)  # mkstemp's 0600 already; stated, not assumed
            write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)  # NFS may report a full disk only here
    except BaseException:
        tmp.unlink(missing_ok=True)  # a failed write (a full disk) leaves no half-written temp file
        raise
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_all(fd: int, data: bytes) -> None:
    """os.write until every byte is written (a write may be short, e.g. on a nearly full disk)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def atomic_write_text(path: Path, text: str) -> None:
    """UTF-8 variant of :func:`atomic_write_bytes`."""
    atomic_write_bytes(path, text.encode("utf-8"))


def fsync_tree(root: Path) -> None:
    """fsync every regular file under ``root`` and every directory, deepest first."""
    for dirpath, _dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def remove_tree(path: Path) -> None:
    """Delete a directory tree; a path that is already gone is not an error."""
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        pass
