"""The training loop's checkpoint saves, which a full disk does not end.

A save that fails on its storage (a full disk, a used-up quota, an I/O error) leaves the trainer's
model and optimizer as they were (a save only reads them) and the complete checkpoints and `latest`
untouched (the checkpoint manager removes the unfinished `tmp_step_<N>`). So in the middle of a run
the loop warns, counts it (the step metric `ckpt/save_failures`) and trains on; the next due save
tries again. The last save of a run (at its last step, or on a stop) is the one the next run
resumes from: it is retried once after a wait, and when that fails too the run fails with
`FinalSaveError` instead of ending as if all were well with trained steps lost. Any other failure
(a bug, a role that died or did not answer) is raised as it was.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from relax_hpc.ckpt.errors import STORAGE_ERRNOS, CheckpointDiskFullError, CheckpointSaveError
from relax_hpc.ckpt.resume_state import ResumeState
from relax_hpc.roles.handles import Roles

log = logging.getLogger(__name__)

SaveFailedHook = Callable[[int, BaseException], None]


class FinalSaveError(RuntimeError):
    """The last checkpoint of a run could not be saved, also on a retry; the message says what to do."""


def storage_failure(error: BaseException) -> BaseException | None:
    """The storage failure that `error` is or carries, or None when it is another failure.

    Ray raises a role's exception as a RayTaskError that is also an instance of the role's
    exception class, keeps the original as `.cause` (looked at first: its text is the role's
    message, not Ray's traceback), and drops `__cause__` on the way. A role that did not answer
    raises a TimeoutError, which is an OSError too, but with no errno.
    """
    for candidate in (getattr(error, "cause", None), error):
        if isinstance(candidate, CheckpointSaveError):
            return candidate
        if isinstance(candidate, OSError) and candidate.errno in STORAGE_ERRNOS:
            return candidate
    return None


def what_to_do(failure: BaseException) -> str:
    """The remedy for a storage failure, naming the filesystem when the error carries it."""
    filesystem = getattr(failure, "filesystem", "") or "the filesystem of the checkpoint directory"
    full = isinstance(failure, CheckpointDiskFullError) or (
        isinstance(failure, OSError) and failure.errno in (errno.ENOSPC, errno.EDQUOT))
    return f"free space on {filesystem}" if full else f"check {filesystem} (I/O errors show in dmesg)"


@dataclass
class CheckpointSaver:
    """Saves through `roles`; storage failures are counted, survived mid-run, and fatal at the end.

    `last_saved`: the step of the newest complete checkpoint (the resumed one at first).
    `on_failed(step, error)` is called for every failed attempt with the storage failure.
    """

    roles: Roles
    retry_wait_s: float
    on_failed: SaveFailedHook
    last_saved: int | None = None
    failures: int = 0
    sleep: Callable[[float], None] = time.sleep

    def save(self, state: ResumeState, is_final: Callable[[int], bool]) -> str | None:
        """The new checkpoint's path, or None when a mid-run save failed (warned and counted).

        `is_final(step)` says whether this is the run's last save; it is asked after a failure,
        since a stop may be requested while the save runs.
        """
        try:
            return self._attempt(state)
        except Exception as error:  # noqa: BLE001 - _failed raises all but storage failures
            failure = self._failed(state.step, error)
            if not is_final(state.step):
                log.warning(
                    "saving the checkpoint of step %d failed: %s. Training goes on and the next "
                    "save tries again (%d failed in this run: metric ckpt/save_failures); the run "
                    "fails if its last save fails too, so %s now",
                    state.step, failure, self.failures, what_to_do(failure))
                return None
        log.warning("saving the checkpoint of step %d, the last of this run, failed: %s. Trying "
                    "once more in %g s", state.step, failure, self.retry_wait_s)
        self.sleep(self.retry_wait_s)
        try:
            return self._attempt(state)
        except Exception as error:
            failure = self._failed(state.step, error)
            newest = f"step_{self.last_saved}" if self.last_saved is not None else "none (no step is saved)"
            raise FinalSaveError(
                f"the checkpoint of step {state.step}, the last of this run, could not be saved "
                f"(tried twice, {self.retry_wait_s:g} s apart): {failure}. The steps trained after "
                f"the newest complete checkpoint ({newest}) are not saved; {what_to_do(failure)}, "
                "then run the job again with [checkpoint] resume = true to redo them"
            ) from error

    def _attempt(self, state: ResumeState) -> str:
        path = self.roles.save_checkpoint(state)
        self.last_saved = state.step
        return path

    def _failed(self, step: int, error: Exception) -> BaseException:
        """The storage failure behind `error`, counted and reported; any other error is raised."""
        failure = storage_failure(error)
        if failure is None:
            raise error
        self.failures += 1
        self.on_failed(step, failure)
        return failure
