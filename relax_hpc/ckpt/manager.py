"""Save and resume training state with torch.distributed.checkpoint (DCP).

``CheckpointManager`` writes model + optimizer (keyed by parameter FQN through
``get_state_dict``), per-rank RNG states and a ``ResumeState`` into ``tmp_step_<N>``,
fsyncs everything, renames it to ``step_<N>``, points ``latest`` at it and prunes old
checkpoints. ``load_latest`` walks back from the newest checkpoint until one loads,
warning about (and never deleting) every unusable one.

Checkpoints are owner-only (directories 0700, files 0600) and ``load_latest`` refuses one
that others could have changed (relax_hpc/ckpt/permissions.py). A save that fails (a full
disk, say) removes its ``tmp_step_<N>``; a failure of the storage (a full disk, an I/O error)
is raised as ``CheckpointSaveError``, which names the filesystem: the model and optimizer were
only read, so the caller may train on and save again later.

Works in one process without a process group and collectively when one is
initialised (every rank calls ``save`` / ``load_latest``; rank 0 alone renames,
writes ``latest`` and prunes). See docs/checkpoints.md.
"""

from __future__ import annotations

import io
import logging
import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.optim import Optimizer

from relax_hpc.ckpt.collective import Collective, default_collective
from relax_hpc.ckpt.errors import (
    DISK_FULL_ERRNOS,
    STORAGE_ERRNOS,
    CheckpointDiskFullError,
    CheckpointSaveError,
    NoUsableCheckpointError,
)
from relax_hpc.ckpt.fs import (
    atomic_write_bytes,
    atomic_write_text,
    fsync_dir,
    fsync_tree,
    remove_tree,
)
from relax_hpc.ckpt.layout import (
    LATEST_FILE,
    list_root,
    load_order,
    parse_latest,
    plan_prune,
    replaced_dir_name,
    rng_file_name,
    step_dir_name,
    tmp_dir_name,
)
from relax_hpc.ckpt.permissions import (
    PRIVATE_DIR_MODE,
    UnsafeCheckpointError,
    check_private,
    make_private_tree,
)
from relax_hpc.ckpt.resume_state import (
    ResumeFile,
    ResumeState,
    read_resume_file,
    write_resume_file,
)
from relax_hpc.ckpt.rng import capture_rng_state, restore_rng_state
from relax_hpc.ckpt.validate import check_dcp_files

__all__ = [
    "STORAGE_ERRNOS",
    "CheckpointDiskFullError",
    "CheckpointManager",
    "CheckpointSaveError",
    "NoUsableCheckpointError",
    "UnsafeCheckpointError",
]

log = logging.getLogger(__name__)
T = TypeVar("T")


class CheckpointManager:
    """DCP checkpoints under ``root`` with ``keep_last`` complete ones retained."""

    def __init__(self, root: Path, keep_last: int = 2, collective: Collective | None = None) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last={keep_last} must be >= 1 (number of complete checkpoints kept)")
        self.root = Path(root)
        self.keep_last = keep_last
        # Resolved per call: the manager is often built before init_process_group().
        self._collective = collective
        # Whether this run resumed (load_latest was called): then `latest` never moves below the
        # newest complete step, unless it already names a step at or below the one saved.
        self._resumed = False
        self._failures: dict[str, str] = {}  # step_<N> -> why it did not load, this load

    def list_complete(self) -> list[int]:
        """Steps with a complete ``step_<N>`` directory, ascending."""
        return list(list_root(self.root).steps)

    def save(self, step: int, model: nn.Module, optimizer: Optimizer, state: ResumeState) -> Path:
        """Write checkpoint ``step`` and return its ``step_<N>`` path (collective when distributed)."""
        return self.save_with(step, state, lambda tmp, coll: _save_dcp(tmp, coll, model, optimizer))

    def save_with(self, step: int, state: ResumeState, write: Callable[[Path, Collective], None]) -> Path:
        """``save`` with the tensors written by ``write(directory, collective)``, collectively.

        For a backend with its own DCP-based format (the Megatron backend's
        ``dist_checkpointing``): ``write`` must leave a complete DCP checkpoint (``.metadata``)
        in ``directory``; RNG states, resume.json, the rename, ``latest`` and pruning are this
        manager's, as for ``save``.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step={step!r} must be an integer >= 0")
        if state.step != step:
            raise ValueError(
                f"ResumeState.step={state.step} differs from save(step={step}); both count completed steps"
            )
        state.to_dict()  # fail before any I/O when data_cursor/extra are not JSON
        coll = self._coll()
        rng = capture_rng_state()
        tmp = self.root / tmp_dir_name(step)
        final = self.root / step_dir_name(step)
        try:
            _run_on_rank0(coll, lambda: _fresh_dir(self.root, tmp), f"creating {tmp}")
            write(tmp, coll)
            _, error = _attempt(lambda: _write_rng(tmp, coll.rank, rng))
            _agree(coll, error, f"writing RNG state into {tmp}")
            _run_on_rank0(
                coll, lambda: self._publish(tmp, final, step, state, coll.world_size), f"publishing {final}"
            )
        # Every failure above reaches every rank (DCP and _agree / _run_on_rank0 see to it),
        # so no rank is still writing into tmp when rank 0 removes it.
        except (Exception, CheckpointException) as exc:
            if coll.rank == 0:
                _remove_unfinished(tmp)
            full = disk_full_cause(exc)
            if full is not None:
                raise self._disk_full_error(final, tmp, full) from exc
            if storage_error_cause(exc) is not None:
                raise self._storage_error(final, tmp, describe_error(exc)) from exc
            raise
        return final

    def load_latest(self, model: nn.Module, optimizer: Optimizer) -> ResumeState | None:
        """Restore the newest usable checkpoint into ``model``/``optimizer`` and the RNGs.

        Returns its ResumeState, or None when there is none. Raises UnsafeCheckpointError,
        before reading anything of it, at a checkpoint others could have changed (group- or
        world-writable, or owned by another user): loading unpickles its files. Unusable checkpoints
        (missing or truncated files, bad JSON, DCP errors) are skipped with a WARNING
        and left on disk. Raises RuntimeError when every checkpoint failed and at least
        one failed inside DCP's load, because the model may then be partly overwritten.
        """
        return self._load_latest(lambda coll, path: self._load_tensors(coll, path, model, optimizer))

    def load_latest_with(self, read: Callable[[Path, Collective], None]) -> ResumeState | None:
        """``load_latest`` with the tensors read by ``read(directory, collective)`` (collective).

        The counterpart of ``save_with``: the same order, permission and file checks, the same
        fallback to older checkpoints; an exception from ``read`` on any rank marks the
        checkpoint unusable on all of them (and the tensors as possibly modified).
        """

        def load(coll: Collective, path: Path) -> tuple[bool, bool]:
            _, error = _attempt(lambda: read(path, coll))
            return self._usable(coll, error, path), True

        return self._load_latest(load)

    def _load_latest(self, load: Callable[[Collective, Path], tuple[bool, bool]]) -> ResumeState | None:
        self._resumed = True
        self._failures = {}
        coll = self._coll()
        order = _compute_on_rank0(coll, self._load_order, f"listing checkpoints in {self.root}")
        dcp_touched = False
        for step in order:
            path = self.root / step_dir_name(step)
            self._refuse_unsafe(coll, path)
            checked, error = _attempt(partial(_check_checkpoint, path, step, coll.rank))
            if not self._usable(coll, error, path) or checked is None:
                continue
            resume, rng = checked
            loaded, touched = load(coll, path)
            dcp_touched = dcp_touched or touched
            if not loaded:
                continue
            if rng is not None:
                restore_rng_state(rng)
            else:
                log.warning(
                    "%s was written by %d ranks; rank %d has no saved RNG state and keeps its current one",
                    path, resume.world_size, coll.rank,
                )
            if coll.rank == 0:
                log.info("resumed from %s (step %d)", path, resume.state.step)
            return resume.state
        if order and dcp_touched:
            raise RuntimeError(
                f"no checkpoint in {self.root} could be loaded (tried "
                f"{', '.join(step_dir_name(s) for s in order)}) and at least one failed inside "
                "torch.distributed.checkpoint.load, so the model and optimizer may be partly "
                "overwritten; see the warnings above, move the broken directories aside and restart"
            )
        if order:
            tried = "; ".join(f"{step_dir_name(s)}: {self._failures.get(step_dir_name(s), 'did not load')}"
                              for s in order)
            raise NoUsableCheckpointError(
                f"none of the complete checkpoints in {self.root} could be loaded ({tried}), so the run "
                "stops rather than start over from step 0 and abandon them (they are left in place). Fix "
                "the cause (a missing or unreadable file, a stale NFS handle: remount, or wait and retry) "
                "and run again to resume; or start over from step 0 on purpose with `relax-hpc run "
                "--start-over` (or [checkpoint] resume = false in the spec)"
            )
        return None

    # -- internals -------------------------------------------------------------------

    def _coll(self) -> Collective:
        return self._collective if self._collective is not None else default_collective()

    def _load_order(self) -> list[int]:
        listing = list_root(self.root)
        for step in listing.replaced:
            if step not in listing.steps:  # a save of the same step crashed between its two renames
                os.rename(self.root / replaced_dir_name(step), self.root / step_dir_name(step))
                fsync_dir(self.root)
                log.warning("restored %s from %s: a second save of that step was interrupted",
                            self.root / step_dir_name(step), replaced_dir_name(step))
        listing = list_root(self.root)
        for name in listing.tmp_dirs:
            log.info("ignoring %s: an unfinished save, removed at the next successful save", self.root / name)
        pointer: int | None = None
        latest = self.root / LATEST_FILE
        if latest.is_file():
            text = latest.read_text(encoding="utf-8", errors="replace")
            pointer = parse_latest(text)
            if pointer is None:
                log.warning("%s holds %r, not 'step_<N>'; scanning step_* directories instead", latest, text)
            elif pointer not in listing.steps:
                log.warning(
                    "%s names %s, which does not exist under %s; scanning step_* directories instead",
                    latest, step_dir_name(pointer), self.root,
                )
        return load_order(pointer, listing.steps)

    def _refuse_unsafe(self, coll: Collective, path: Path) -> None:
        """Raise UnsafeCheckpointError on every rank when ``path`` is unsafe.

        Rank 0 alone looks: DCP loads from a filesystem all ranks share, and on a large job
        one rank's stat calls are enough metadata load.
        """
        problem: str | None = None
        if coll.rank == 0:
            try:
                check_private(self.root, path)
            except UnsafeCheckpointError as exc:
                problem = str(exc)
            except OSError:
                pass  # a path that vanished or cannot be read: the usability checks report it
        problem = coll.broadcast_from_rank0(problem)
        if problem is not None:
            raise UnsafeCheckpointError(problem)

    def _disk_full_error(self, final: Path, tmp: Path, cause: str) -> CheckpointDiskFullError:
        filesystem = str(mount_point(self.root))
        return CheckpointDiskFullError(
            f"saving checkpoint {final.name} failed: the disk holding {self.root} is full or your "
            f"quota there is used up ({cause}). The unfinished {tmp} was removed and the "
            f"checkpoints already there are untouched ({self._newest()}). Free space on {filesystem} "
            f"(df -h {self.root}), lower [checkpoint] keep_last, or set [job] output_dir on a "
            "filesystem with room",
            filesystem,
        )

    def _storage_error(self, final: Path, tmp: Path, cause: str) -> CheckpointSaveError:
        filesystem = str(mount_point(self.root))
        return CheckpointSaveError(
            f"saving checkpoint {final.name} failed on the filesystem holding {self.root} "
            f"(mounted at {filesystem}): {cause}. The unfinished {tmp} was removed and the "
            f"checkpoints already there are untouched ({self._newest()}). Check that filesystem "
            "(an I/O error or a read-only remount shows in dmesg on this host and in its status), "
            "or set [job] output_dir on another one",
            filesystem,
        )

    def _newest(self) -> str:
        try:
            steps = list_root(self.root).steps
        except OSError:
            return "they could not be listed"
        return f"newest: {step_dir_name(steps[-1])}" if steps else "there are none"

    def _usable(self, coll: Collective, local_error: str | None, path: Path) -> bool:
        errors = coll.all_gather(local_error)
        failed = [(rank, err) for rank, err in enumerate(errors) if err is not None]
        if failed:
            self._failures[path.name] = "; ".join(f"rank {rank}: {err}" for rank, err in failed)
        if failed and coll.rank == 0:
            details = self._failures[path.name]
            log.warning(
                "checkpoint %s is unusable (%s); trying the previous one, if any. It was NOT "
                "deleted: inspect it, then remove it by hand",
                path, details,
            )
        return not failed

    def _load_tensors(
        self, coll: Collective, path: Path, model: nn.Module, optimizer: Optimizer
    ) -> tuple[bool, bool]:
        """Load ``path`` in place; returns (loaded, whether tensors may have been modified)."""
        state, error = _attempt(lambda: get_state_dict(model, optimizer))
        if not self._usable(coll, error, path) or state is None:
            return False, False
        holder: dict[str, Any] = {"model": state[0], "optim": state[1]}
        # DCP's load is itself collective and raises the same error on every rank.
        with single_process_quiet():
            _, error = _attempt(
                lambda: dcp.load(
                    holder,
                    checkpoint_id=path,
                    process_group=coll.process_group,
                    no_dist=not coll.is_distributed,
                )
            )
        if not self._usable(coll, error, path):
            return False, True
        _, error = _attempt(
            lambda: set_state_dict(
                model, optimizer, model_state_dict=holder["model"], optim_state_dict=holder["optim"]
            )
        )
        return self._usable(coll, error, path), True

    def _publish(self, tmp: Path, final: Path, step: int, state: ResumeState, world_size: int) -> None:
        write_resume_file(tmp, state, world_size)
        make_private_tree(tmp)  # DCP creates its files with the process umask
        fsync_tree(tmp)
        # Saving the same step twice (e.g. a preemption right after a periodic save): the old one
        # is moved aside under a name that is not tmp_, since after a crash between the two
        # renames it is the only complete copy: the next load renames it back, pruning keeps it.
        replaced = self.root / replaced_dir_name(step)
        if final.exists():
            remove_tree(replaced)  # a leftover whose step_<N> is complete: not the only copy
            os.rename(final, replaced)
            fsync_dir(self.root)
        os.rename(tmp, final)
        fsync_dir(self.root)
        self._point_latest(step)
        remove_tree(replaced)
        self._prune(step)

    def _point_latest(self, step: int) -> None:
        """Point `latest` at ``step``, except in a resumed run when a newer complete step exists and
        `latest` names one above ``step`` (it did not load at resume): moving it would abandon it."""
        newer = [s for s in list_root(self.root).steps if s > step]
        if self._resumed and newer:
            latest = self.root / LATEST_FILE
            pointer = parse_latest(latest.read_text(encoding="utf-8", errors="replace")) if latest.is_file() else None
            if pointer is None or pointer > step:
                log.warning(
                    "saved %s, but %s keeps naming %s: the newest complete checkpoint, which did not load "
                    "at resume (see the warnings then). The next resume tries it first; to continue from "
                    "%s instead, write %s into %s", step_dir_name(step), latest,
                    step_dir_name(pointer if pointer is not None else newer[-1]), step_dir_name(step),
                    step_dir_name(step), latest)
                return
        atomic_write_text(self.root / LATEST_FILE, step_dir_name(step) + "\n")

    def _prune(self, step: int) -> None:
        try:
            listing = list_root(self.root)
            plan = plan_prune(step, listing.steps, self.keep_last)
            for old in plan.delete:
                remove_tree(self.root / step_dir_name(old))
            for name in listing.tmp_dirs:
                remove_tree(self.root / name)
        except OSError as exc:
            log.warning(
                "checkpoint %s is complete, but pruning old ones under %s failed (%r); remove "
                "old step_* / tmp_* directories by hand",
                step_dir_name(step), self.root, exc,
            )
            return
        if plan.newer_kept:
            log.warning(
                "%s holds checkpoints newer than the one just saved (%s), probably from a run "
                "that was rolled back; they are kept and not counted in keep_last=%d",
                self.root, ", ".join(step_dir_name(s) for s in plan.newer_kept), self.keep_last,
            )


@contextmanager
def single_process_quiet() -> Iterator[None]:
    """Silence DCP's warning that it runs in one process; that is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _save_dcp(tmp: Path, coll: Collective, model: nn.Module, optimizer: Optimizer) -> None:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    with single_process_quiet():
        dcp.save(
            {"model": model_sd, "optim": optim_sd},
            checkpoint_id=tmp,
            process_group=coll.process_group,
            no_dist=not coll.is_distributed,
        )


def _fresh_dir(root: Path, tmp: Path) -> None:
    # Owner-only when created here; an existing root keeps its mode (load_latest checks it).
    root.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR_MODE)
    remove_tree(tmp)  # left by a save of this step that crashed
    tmp.mkdir(mode=PRIVATE_DIR_MODE)


def _remove_unfinished(tmp: Path) -> None:
    try:
        remove_tree(tmp)
    except OSError as exc:  # never hide the save's own error behind this one
        log.warning("could not remove the unfinished %s (%r); remove it by hand", tmp, exc)


def mount_point(path: Path) -> Path:
    """The mount point of the filesystem holding ``path`` (or its nearest existing parent)."""
    current = Path(os.path.abspath(path))
    while not current.exists() and current != current.parent:
        current = current.parent
    while not os.path.ismount(current) and current != current.parent:
        current = current.parent
    return current


def disk_full_cause(exc: BaseException) -> str | None:
    """The description of the out-of-space error behind ``exc`` (ENOSPC or EDQUOT), or None.

    Follows causes and DCP's per-rank failures; failing an OSError there, looks for the
    error's text, which is how other ranks' errors arrive (as strings).
    """
    return _os_error_cause(exc, DISK_FULL_ERRNOS)


def storage_error_cause(exc: BaseException) -> str | None:
    """As ``disk_full_cause``, for any failure of the storage (``STORAGE_ERRNOS``)."""
    return _os_error_cause(exc, STORAGE_ERRNOS)


def _os_error_cause(exc: BaseException, errnos: tuple[int, ...]) -> str | None:
    chain: list[BaseException] = []
    pending = [exc]
    while pending:
        current = pending.pop(0)
        if any(current is seen for seen in chain):
            continue
        chain.append(current)
        if isinstance(current, CheckpointException):
            pending.extend(cause for cause, _ in current.failures.values())
        pending.extend(e for e in (current.__cause__, current.__context__) if e is not None)
    for current in chain:
        if isinstance(current, OSError) and current.errno in errnos:
            return str(current)
    for current in chain:
        text = " ".join(str(current).split())
        if not isinstance(current, CheckpointException) and any(os.strerror(c) in text for c in errnos):
            return text
    return None


def _write_rng(directory: Path, rank: int, rng: dict[str, Any]) -> None:
    buffer = io.BytesIO()
    torch.save(rng, buffer)
    atomic_write_bytes(directory / rng_file_name(rank), buffer.getvalue())


def _check_checkpoint(path: Path, step: int, rank: int) -> tuple[ResumeFile, dict[str, Any] | None]:
    """Cheap checks before any tensor is touched: JSON, RNG file and DCP file sizes."""
    resume = read_resume_file(path)
    if resume.state.step != step:
        raise ValueError(f"resume.json says step {resume.state.step} but the directory is {path.name}")
    rng: dict[str, Any] | None = None
    if rank < resume.world_size:
        rng = torch.load(path / rng_file_name(rank), weights_only=True)
    check_dcp_files(path)
    return resume, rng


def _attempt(action: Callable[[], T]) -> tuple[T | None, str | None]:
    """Run ``action``; return (result, None) or (None, a one-line description of the error)."""
    try:
        return action(), None
    # CheckpointException derives from BaseException, not Exception.
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - reported to all ranks
        return None, describe_error(exc)


def describe_error(exc: BaseException, limit: int = 300) -> str:
    """A short one-line description; DCP's CheckpointException is reduced to its causes."""
    if isinstance(exc, CheckpointException):
        causes = [f"rank {rank}: {describe_error(cause, limit)}" for rank, (cause, _) in exc.failures.items()]
        return "DCP failed (" + "; ".join(causes) + ")"
    text = " ".join(str(exc).split())
    if len(text) > limit:
        text = text[:limit] + "..."
    return f"{type(exc).__name__}: {text}"


def _agree(coll: Collective, local_error: str | None, what: str) -> None:
    """Raise on every rank when ``what`` failed on any rank."""
    failed = [(r, e) for r, e in enumerate(coll.all_gather(local_error)) if e is not None]
    if failed:
        raise RuntimeError(f"{what} failed: " + "; ".join(f"rank {r}: {e}" for r, e in failed))


def _compute_on_rank0(coll: Collective, compute: Callable[[], T], what: str) -> T:
    """Run ``compute`` on rank 0 and hand its result (or its failure) to every rank."""
    result: T | None = None
    error: str | None = None
    failure: Exception | None = None
    if coll.rank == 0:
        try:
            result = compute()
        except Exception as exc:
            if coll.world_size == 1:
                raise
            failure = exc
            error = f"{what} failed on rank 0: {describe_error(exc)}"
    # Broadcast even on failure, so the other ranks raise instead of waiting forever.
    result, error = coll.broadcast_from_rank0((result, error))
    if error is not None:
        raise RuntimeError(error) from failure
    return result  # type: ignore[return-value]


def _run_on_rank0(coll: Collective, action: Callable[[], None], what: str) -> None:
    _compute_on_rank0(coll, action, what)
