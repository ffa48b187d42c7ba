"""Global restarts: when a role cannot be healed in place, every role is rebuilt and the loop
resumes from the newest complete checkpoint, in the same driver process.

What triggers one: a trainer rank, rollout or ActorFwd that died (`RoleDiedError`) or stopped
answering (`RoleTimeoutError`, or its heartbeat went stale: `GlobalRestartNeeded`), a broken
weight broadcast (`WeightChannelError`), or a role that failed `max_in_place_restarts` times
(relax_hpc/roles/healing.py decides). A role that *raises* (a bug, a bad reward function) is not
restarted: the same inputs would fail the same way, so the run fails with that error.

Steps trained after the newest checkpoint are trained again from it, with the same prompts
(the data cursor is part of the checkpoint), so each planned sample ends up trained exactly
once in the model the run finishes with (`relax-hpc inspect JOBDIR --check-exactly-once`).
After `max_global_restarts` the next failure ends the run (`RestartsExhausted`). A driver that
is itself killed is restarted from outside: on Slurm the batch script requeues the job
(docs/slurm.md); on this machine, run the same command again.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

from relax_hpc.driver.checkpointing import SaveFailedHook
from relax_hpc.driver.loop import LoopResult, LoopSpec, StopFlag, run_loop
from relax_hpc.ops.metrics import MetricsSink
from relax_hpc.roles.errors import GlobalRestartNeeded, RestartsExhausted
from relax_hpc.roles.handles import RoleDiedError, Roles, RoleTimeoutError
from relax_hpc.roles.healing import RoleHealer
from relax_hpc.weights.channel import WeightChannelError

log = logging.getLogger(__name__)

RESTARTABLE = (RoleDiedError, RoleTimeoutError, GlobalRestartNeeded, WeightChannelError)


class RebuildableRoles:
    """The driver's `Roles`, rebuilt on a global restart; the REST API and the grow policy hold
    this one handle, so they reach the new roles without knowing."""

    def __init__(self, build: Callable[[], Roles]) -> None:
        self._build = build
        self.current = build()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.current, name)

    def rebuild(self) -> None:
        """Kill every role at once (a hung one would not answer a polite stop) and start anew."""
        shutdown = self.current.shutdown
        try:
            shutdown(abandon=True)  # type: ignore[call-arg]
        except Exception as e:  # noqa: BLE001 - the old roles are being replaced anyway
            log.warning("tearing down the old roles: %s: %s", type(e).__name__, e)
        self.current = self._build()


def failure_of(error: BaseException) -> tuple[str, str]:
    """(role, problem) of a restartable error, for the restart's event."""
    if isinstance(error, RoleDiedError):
        return error.role or "a role", "died" if "could not start" not in str(error) else "could not start"
    if isinstance(error, RoleTimeoutError):
        return "a role", "did not answer"
    return "the weight channel", "failed"


def run_with_restarts(spec: LoopSpec, roles: RebuildableRoles, metrics: MetricsSink, stop: StopFlag,
                      on_step: Callable[[int, dict[str, float]], None], healer: RoleHealer | None,
                      on_restart: Callable[[], None] = lambda: None,
                      on_save_failed: SaveFailedHook = lambda step, error: None) -> LoopResult:
    """`run_loop`, with global restarts (module docstring). `on_restart` runs after the roles
    were rebuilt, before the loop resumes; `on_save_failed` as run_loop's."""
    rewards: dict[int, float] = {}  # by the step count after the step, as metrics.jsonl has it

    def record(step: int, m: dict[str, float]) -> None:
        rewards[step] = m["reward/mean"]  # a step trained again replaces its first reward
        on_step(step, m)

    restarted = False
    while True:
        try:
            result = run_loop(spec, roles, metrics, stop, record,  # type: ignore[arg-type]
                              on_save_failed=on_save_failed, restarted=restarted)
            break
        except RestartsExhausted:
            raise
        except RESTARTABLE as error:
            if healer is None or stop.requested:
                raise
            if not isinstance(error, GlobalRestartNeeded):
                role, problem = failure_of(error)
                lines = str(error).strip().splitlines()
                detail = lines[0].split(";")[0][:200] if lines else type(error).__name__
                try:
                    healer.global_restart(role, problem, detail)
                except RestartsExhausted as exhausted:
                    raise exhausted from error
            print("global restart: every role is rebuilt; the run resumes from its newest checkpoint",
                  file=sys.stderr)
            roles.rebuild()
            healer.reset_after_global_restart()
            on_restart()
            restarted = True  # resume from the newest checkpoint, whatever [checkpoint] resume says
    if rewards:  # an earlier attempt may have started before the checkpoint the last one resumed
        result.start_step = min(result.start_step, min(rewards) - 1)
    result.rewards = [rewards[s] for s in sorted(rewards)]
    return result
