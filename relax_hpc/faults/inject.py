"""The file-system faults of the fault suite: a damaged newest checkpoint, and a checkpoint
directory on a small file system that is filled up just before a save.

The full disk is real: a tmpfs mounted over JOBDIR/checkpoints (mounting needs root) and a
ballast file that takes every free byte, so the save fails inside torch's own writes as it
would on a full shared file system. `SmallFilesystem` always unmounts, also when the run failed.
"""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path
from types import TracebackType

from relax_hpc.ckpt.layout import LATEST_FILE, list_root, parse_latest

BALLAST = ".fault-ballast"
_CHUNK = 1 << 20
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def checkpoint_steps(root: Path) -> list[int]:
    """Complete checkpoints (step_<N>) under `root`, ascending."""
    return list(list_root(root).steps)


def latest_step(root: Path) -> int | None:
    """The step the `latest` pointer names, None without one."""
    try:
        return parse_latest((root / LATEST_FILE).read_text())
    except OSError:
        return None


def corrupt_checkpoint(path: Path) -> Path:
    """Truncate the largest DCP data file of checkpoint `path` to half its size (what a crash or
    a full disk leaves); returns the file. Loading must then skip this checkpoint."""
    shards = sorted(path.glob("*.distcp"), key=lambda p: p.stat().st_size, reverse=True)
    if not shards:
        raise FileNotFoundError(f"{path} holds no DCP data file (*.distcp) to corrupt")
    with shards[0].open("r+b") as f:
        f.truncate(shards[0].stat().st_size // 2)
    return shards[0]


def checkpoint_bytes_estimate(model_path: Path) -> int:
    """A generous size of one checkpoint: the weights' files times 6 (float32 weights and Adam's
    two moments, from weights stored in half precision), for sizing the small file system."""
    weights = sum(p.stat().st_size for p in Path(model_path).rglob("*")
                  if p.is_file() and p.suffix in _WEIGHT_SUFFIXES)
    return 6 * weights


def small_fs_bytes(model_path: Path, keep_last: int) -> int:
    """Room for the checkpoints a run keeps, the one being written and the one it replaces."""
    return (keep_last + 2) * checkpoint_bytes_estimate(model_path) + (16 << 20)


class SmallFilesystem:
    """A tmpfs of `size_bytes` mounted (mode 0700) at `path` for a `with` block.

    `MountError` on entry when it cannot be mounted (not root, no `mount`): the caller reports
    the fault as not run. The mount is undone on exit (lazily, when something still holds it).
    """

    def __init__(self, path: Path, size_bytes: int) -> None:
        self.path, self.size_bytes = Path(path), size_bytes

    def mount(self) -> None:
        if os.geteuid() != 0:
            raise MountError("needs root to mount a small file system")
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        _run(["mount", "-t", "tmpfs", "-o", f"size={self.size_bytes},mode=0700", "tmpfs", str(self.path)],
             f"mounting a {self.size_bytes >> 20} MiB tmpfs at {self.path}")

    def unmount(self) -> None:
        unmount(self.path)

    def __enter__(self) -> SmallFilesystem:
        self.mount()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.unmount()

    def fill(self) -> int:
        """Write a ballast file until the file system is full; returns its size in bytes."""
        ballast = self.path / BALLAST
        written = 0
        zeros = bytes(_CHUNK)
        with ballast.open("wb", buffering=0) as f:
            for size in (_CHUNK, 4096, 1):  # large writes, then what fits of the last bytes
                block = zeros[:size]
                while True:
                    try:
                        written += f.write(block) or 0
                    except OSError as e:
                        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                            raise
                        break
        return written

    def free(self) -> None:
        """Remove the ballast: the next save has room again."""
        (self.path / BALLAST).unlink(missing_ok=True)

    def free_bytes(self) -> int:
        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize


class MountError(RuntimeError):
    """The small file system could not be mounted."""


def unmount(path: Path) -> None:
    """Unmount `path` if it is a mount point: plainly, else lazily (a process still holds it)."""
    if not os.path.ismount(path):
        return
    try:
        _run(["umount", str(path)], f"unmounting {path}")
    except MountError:
        _run(["umount", "-l", str(path)], f"unmounting {path} lazily")


def _run(command: list[str], what: str) -> None:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise MountError(f"{what} failed: {e}") from e
    if done.returncode != 0:
        raise MountError(f"{what} failed: {(done.stderr or done.stdout).strip()}")


def newest_and_previous(root: Path) -> tuple[int, int] | None:
    """The newest complete checkpoint and the one before it, or None with fewer than two."""
    steps = checkpoint_steps(root)
    return (steps[-1], steps[-2]) if len(steps) >= 2 else None
