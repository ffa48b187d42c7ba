"""The job directory: one run at a time, and owner-only.

    with JobDirLock(job_dir):    # JobDirBusyError at once when another run holds the directory
        ...                      # the whole run

`relax-hpc run` holds an exclusive, non-blocking `fcntl.flock` on JOBDIR/.lock for the whole
run and writes its pid and host into that file, so a second run on the same directory stops
before it touches anything (it would delete the first run's checkpoint in progress) and names
the holder. The kernel drops the lock when the holder ends, however it ends (kill -9 included),
so a .lock file left behind never blocks: the next run takes the lock and overwrites it. The
lock file is never deleted (a run that deleted it could lock a new file while another run still
holds the old one).

Directories created here are 0700 and files 0600; an existing directory keeps its mode, but one
that group or others may write, or that another user owns, is refused (`UnsafePathError`): its
files would be theirs to plant. The lock file is opened without following a symbolic link.
See docs/security.md, "Job directory".
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path

from relax_hpc.ckpt.permissions import PRIVATE_DIR_MODE
from relax_hpc.ops.files import NO_LOCKS, UnsafePathError, check_private_dir, open_private

__all__ = [
    "LOCK_FILE",
    "JobDirBusyError",
    "JobDirLock",
    "UnsafePathError",
    "create_private_file",
    "make_private_dir",
]

log = logging.getLogger(__name__)

LOCK_FILE = ".lock"


class JobDirBusyError(ValueError):
    """Another run holds the job directory.

    A ValueError, like the spec problems the CLI reports on one line: the spec's [job]
    output_dir names a directory that is in use.
    """


def make_private_dir(path: Path, what: str = "directory") -> Path:
    """Create ``path`` (and missing parents) if needed, the directory itself 0700 when created;
    UnsafePathError when it exists and group or others may write it, or another user owns it."""
    path.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR_MODE)
    check_private_dir(path, what)
    return path


def create_private_file(path: Path) -> None:
    """Create an empty ``path`` 0600 unless it exists, for a writer that opens it to append;
    UnsafePathError for a symbolic link or a file others may write."""
    os.close(open_private(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND))


class JobDirLock:
    """An exclusive flock on JOBDIR/.lock; creates JOBDIR (0700) when it is missing."""

    def __init__(self, job_dir: Path) -> None:
        self.job_dir = Path(job_dir)
        self.path = self.job_dir / LOCK_FILE
        self._fd: int | None = None

    def __enter__(self) -> Path:
        self.acquire()
        return self.job_dir

    def __exit__(self, *_exc: object) -> None:
        self.release()

    def acquire(self) -> None:
        """Take the lock or raise JobDirBusyError naming the holder; never waits."""
        make_private_dir(self.job_dir, "job directory")
        # No O_TRUNC: the holder's pid and host must survive until we own the lock. No symbolic
        # link either: a planted .lock -> a file of ours would be truncated below.
        fd = open_private(self.path, os.O_RDWR | os.O_CREAT, "the job directory's lock file")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _read_holder(fd) if isinstance(exc, BlockingIOError) else ""
            os.close(fd)
            if isinstance(exc, BlockingIOError):
                raise JobDirBusyError(
                    f"job directory {self.job_dir} is in use by another relax-hpc run ({holder}); "
                    "wait for it to finish (or stop it), or set [job] output_dir to another directory"
                ) from None
            if exc.errno not in NO_LOCKS:
                raise
            log.warning(
                "cannot lock %s (%s): this filesystem does not support flock, so nothing stops a "
                "second run on %s; make sure only one run uses it", self.path, exc.strerror, self.job_dir,
            )
            return
        self._fd = fd
        try:
            _write_holder(fd)
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        """Drop the lock (also for any copy of the descriptor a forked child may hold)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)  # nobody holds it now: no owner to name
        except OSError:
            pass
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


def _write_holder(fd: int) -> None:
    holder = {"pid": os.getpid(), "host": socket.gethostname(),
              "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    data = (json.dumps(holder) + "\n").encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)


def _read_holder(fd: int) -> str:
    """'pid P on host H, started T' from a lock file someone else holds."""
    try:
        holder = json.loads(os.pread(fd, 4096, 0) or b"null")
        return f"pid {holder['pid']} on host {holder['host']}, started {holder['started']}"
    except (OSError, ValueError, TypeError, KeyError):
        return "its pid and host are not written yet: it is just starting"
