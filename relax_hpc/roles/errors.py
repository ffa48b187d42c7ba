"""How a role fails, as the driver sees it: it died, it did not answer, or the health manager
decided it must be restarted (relax_hpc/roles/healing.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from relax_hpc.ops.health import HealthEvent


def short_cause(error: BaseException) -> str:
    """The cause of a role's failure in a few words, for its health event."""
    text = str(error).strip().split(";")[0] or type(error).__name__
    return text if len(text) <= 160 else text[:157] + "..."


class RoleDiedError(RuntimeError):
    """A role's process died (Ray reports its actor dead); the message names it and its log.
    `role` is its health name ("trainer_rank_1", "rollout", "reference", ...)."""

    role: str = ""


class RoleTimeoutError(TimeoutError):
    """A role did not answer a call within the call's deadline; the message names it and its log."""


class RoleFailure(RoleDiedError):
    """A role failure the health manager decided about; `event` says which role and why. A
    RoleDiedError, so the loop passes it on as the cause (waiting for nothing it broke)."""

    def __init__(self, event: HealthEvent) -> None:
        super().__init__(event.line())
        self.event = event
        self.role = event.role


class GlobalRestartNeeded(RoleFailure):
    """Tear every role down and resume the run from its newest checkpoint."""


class RestartsExhausted(RoleFailure):
    """A failure with no global restarts left: the run fails."""
