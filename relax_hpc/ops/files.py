"""Job-directory files others must not be able to plant or change: private writes, locks, checks.

    write_private_text(path, text)           # write-then-rename, 0600, a fresh temp name (O_EXCL)
    check_private_dir(job_dir, "job directory")  # UnsafePathError: group/others may write, or not ours
    text = read_private_text(path)           # None when missing; UnsafePathError for a foreign file
    with exclusive_lock(fed / ".lock"):      # blocks until no other process of ours holds it
        ...

The job directory holds what the job later trusts (its lock, ``cluster.json`` with the REST URL
the token is sent to, checkpoints that are unpickled), so a directory that another user owns or
may write is refused, files are opened without following a planted symbolic link
(``O_NOFOLLOW``), temp files get names nobody can guess beforehand (``mkstemp``: ``O_EXCL``), and
a file read for trust must be a regular file of ours that only we may write. See
docs/security.md, "Job directory".

The ckpt package has the durable write (fsync, relax_hpc/ckpt/fs.py); ``write_private_text`` is
for small files rewritten every few seconds (heartbeats, status.json), where a crash only loses
the newest, so it skips the fsync.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600

__all__ = [
    "PRIVATE_DIR_MODE",
    "PRIVATE_FILE_MODE",
    "UnsafePathError",
    "check_private_dir",
    "exclusive_lock",
    "open_private",
    "read_private_text",
    "unsafe_paths",
    "write_private_text",
]

log = logging.getLogger(__name__)

# flock failures that mean "this filesystem has no locks" (Lustre mounted without -o flock).
NO_LOCKS = frozenset({errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP})


class UnsafePathError(ValueError):
    """A job-directory path that another user could have planted or changed.

    A ValueError, like the other problems a user fixes before running again (the CLI prints it
    on one line); the message names the path, what is wrong and the fix.
    """


def check_private_dir(path: Path, what: str) -> None:
    """Raise UnsafePathError when the directory ``path`` is writable by group or others, or owned
    by another user (root counts as ours). A symbolic link is judged by its target.

    ``what``: how the message names it ("job directory", "federation directory")."""
    problems = unsafe_paths([Path(path)])
    if not problems:
        return
    foreign = any("owned by uid" in p for p in problems)
    fix = ("set [job] output_dir to a directory of your own (or copy this one, `cp -r`, so that you own it)"
           if foreign else f"if nobody else wrote into it, run `chmod go-w {path}` and run again; otherwise "
           "set [job] output_dir to a new directory")
    raise UnsafePathError(
        f"refusing the {what} {'; '.join(problems)}: other users could plant files there that the job "
        f"trusts (its lock, cluster.json, checkpoints, temp files); {fix}")


def open_private(path: Path, flags: int, what: str = "file") -> int:
    """``os.open(path, flags | O_NOFOLLOW, 0600)`` for a file of ours: a symbolic link, anything but
    a regular file, a file of another user or one group/others may write raises UnsafePathError
    (the descriptor closed). The caller closes the descriptor it gets."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, PRIVATE_FILE_MODE)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafePathError(
                f"refusing {what} {path}: it is a symbolic link, which relax-hpc never makes there (someone "
                f"may have planted it to make the job write elsewhere); remove it (`rm {path}`) and run "
                "again") from None
        raise
    try:
        info = os.fstat(fd)
        mode = stat.S_IMODE(info.st_mode)
        problem = None
        if not stat.S_ISREG(info.st_mode):
            problem = "it is not a regular file"
        elif info.st_uid not in (os.geteuid(), 0):
            problem = f"it is owned by uid {info.st_uid}, not by you (uid {os.geteuid()})"
        elif mode & (stat.S_IWGRP | stat.S_IWOTH):
            problem = f"its mode {mode:04o} lets others write it"
        if problem is not None:
            raise UnsafePathError(
                f"refusing {what} {path}: {problem}, so another user may have written it; check it, then "
                f"remove it (`rm {path}`: relax-hpc writes a new one) and run again")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_private_text(path: Path, what: str = "file") -> str | None:
    """The text of ``path``, a file only we may write (``open_private``); None when it is missing."""
    try:
        fd = open_private(path, os.O_RDONLY, what)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "r", encoding="utf-8") as f:
        return f.read()


def write_private_text(path: Path, text: str) -> None:
    """Write-then-rename, mode 0600, creating the directory (0700) when missing; a reader sees
    the old file or the new one, never a part. The temp name is fresh (mkstemp, O_EXCL), so
    concurrent writers and planted names cannot meet in one temp file."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # 0600
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextmanager
def exclusive_lock(path: Path, what: str = "lock file") -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created 0600, never through a symbolic link),
    waiting for another holder; on a filesystem without locks, warn once and go on unlocked."""
    fd = open_private(path, os.O_RDWR | os.O_CREAT, what)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as exc:
            if exc.errno not in NO_LOCKS:
                raise
            log.warning("cannot lock %s (%s): this filesystem does not support flock, so concurrent writers "
                        "are not kept apart; run one at a time", path, exc.strerror)
        yield
    finally:
        os.close(fd)  # closing drops the lock


def unsafe_paths(paths: list[Path]) -> list[str]:
    """One line per path that others could change: writable by group/others, or not ours.

    Symlinks are followed (a checkpoint root may be a link to scratch space): the target is
    what gets read. Root-owned paths count as ours; root can change anything anyway.
    """
    me = os.geteuid()
    problems: list[str] = []
    for path in paths:
        info = path.stat()
        mode = stat.S_IMODE(info.st_mode)
        if mode & (stat.S_IWGRP | stat.S_IWOTH):
            problems.append(f"{path} (mode {mode:04o}: writable by {_who(mode)})")
        if info.st_uid not in (me, 0):
            problems.append(f"{path} (owned by uid {info.st_uid}; you are uid {me})")
    return problems


def _who(mode: int) -> str:
    both = (mode & stat.S_IWGRP) and (mode & stat.S_IWOTH)
    return "group and others" if both else ("group" if mode & stat.S_IWGRP else "others")
