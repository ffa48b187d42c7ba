"""Names and pure decisions for the checkpoint directory layout.

Under a checkpoint root::

    tmp_step_<N>/       being written (DCP files, resume.json, rng_rank<r>.pt); never read
    step_<N>/           complete: renamed from tmp_step_<N> once everything is on disk
    replaced_step_<N>/  a complete step_<N> moved aside while the same step is saved again;
                        removed once the new step_<N> is in place, renamed back to step_<N>
                        by the next load when a crash came between the two renames
    latest              text "step_<N>", written write-then-rename

The functions here only compute names, orders and prune plans from listings, so the
rules are unit-testable without touching a filesystem.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "LATEST_FILE",
    "REPLACED_PREFIX",
    "TMP_PREFIX",
    "PrunePlan",
    "RootListing",
    "list_root",
    "load_order",
    "parse_latest",
    "parse_step_dir",
    "plan_prune",
    "replaced_dir_name",
    "rng_file_name",
    "step_dir_name",
    "tmp_dir_name",
]

LATEST_FILE = "latest"
TMP_PREFIX = "tmp_"
REPLACED_PREFIX = "replaced_"
_STEP_RE = re.compile(r"^step_(\d+)$")


def step_dir_name(step: int) -> str:
    """Name of the complete checkpoint directory for ``step``."""
    return f"step_{step}"


def tmp_dir_name(step: int) -> str:
    """Name of the directory a checkpoint for ``step`` is written into before the rename."""
    return f"{TMP_PREFIX}step_{step}"


def replaced_dir_name(step: int) -> str:
    """Name a complete ``step_<N>`` is moved to while the same step is saved again; not ``tmp_``:
    after a crash between the two renames it is the only complete copy, which pruning must keep."""
    return f"{REPLACED_PREFIX}step_{step}"


def rng_file_name(rank: int) -> str:
    """Per-rank RNG state file inside a checkpoint directory."""
    return f"rng_rank{rank}.pt"


def parse_step_dir(name: str) -> int | None:
    """The step of a ``step_<N>`` name, or None for anything else."""
    match = _STEP_RE.match(name)
    return int(match.group(1)) if match else None


def parse_latest(text: str) -> int | None:
    """The step named by the ``latest`` pointer's content, or None when it is malformed."""
    return parse_step_dir(text.strip())


@dataclass(frozen=True)
class RootListing:
    """What a checkpoint root holds: complete steps (ascending), leftover temp dirs, and the steps
    of ``replaced_step_<N>`` directories (ascending)."""

    steps: tuple[int, ...]
    tmp_dirs: tuple[str, ...]
    replaced: tuple[int, ...] = ()


def list_root(root: Path) -> RootListing:
    """List complete ``step_<N>`` directories, ``tmp_*`` leftovers and ``replaced_step_<N>`` under ``root``.

    A missing root lists nothing; any other failure to read it (a stale NFS handle, no
    permission) is raised, never taken for an empty root: that would start a run over."""
    try:
        entries = list(os.scandir(root))
    except (FileNotFoundError, NotADirectoryError):
        return RootListing(steps=(), tmp_dirs=())
    steps: list[int] = []
    tmp_dirs: list[str] = []
    replaced: list[int] = []
    for entry in entries:
        if not entry.is_dir():  # raises on errors other than a missing target
            continue
        step = parse_step_dir(entry.name)
        if step is not None:
            steps.append(step)
        elif entry.name.startswith(TMP_PREFIX):
            tmp_dirs.append(entry.name)
        elif entry.name.startswith(REPLACED_PREFIX):
            old = parse_step_dir(entry.name.removeprefix(REPLACED_PREFIX))
            if old is not None:
                replaced.append(old)
    return RootListing(steps=tuple(sorted(steps)), tmp_dirs=tuple(sorted(tmp_dirs)),
                       replaced=tuple(sorted(replaced)))


def load_order(pointer_step: int | None, complete_steps: Iterable[int]) -> list[int]:
    """Order in which to try checkpoints: the ``latest`` target, then newest to oldest.

    The pointer goes first even when a newer directory exists, so a user who points
    ``latest`` at an older step to roll back gets that step. A pointer to a directory
    that does not exist is skipped.
    """
    steps = sorted(set(complete_steps), reverse=True)
    if pointer_step is not None and pointer_step in steps:
        steps.remove(pointer_step)
        steps.insert(0, pointer_step)
    return steps


@dataclass(frozen=True)
class PrunePlan:
    """Which complete checkpoints to delete and which newer ones were left alone."""

    delete: tuple[int, ...]
    newer_kept: tuple[int, ...]


def plan_prune(just_saved: int, complete_steps: Iterable[int], keep_last: int) -> PrunePlan:
    """Keep ``just_saved`` and the ``keep_last - 1`` newest older ones; delete the rest.

    Steps newer than ``just_saved`` come from a run that was rolled back; they are the
    user's data, so they are kept (and reported) rather than deleted or counted.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last={keep_last} must be >= 1")
    steps = set(complete_steps)
    older = sorted((s for s in steps if s < just_saved), reverse=True)
    newer = sorted(s for s in steps if s > just_saved)
    return PrunePlan(delete=tuple(sorted(older[keep_last - 1 :])), newer_kept=tuple(newer))
