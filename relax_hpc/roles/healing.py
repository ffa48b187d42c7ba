"""The health manager's side in the driver: who is stale or dead, and what to do about it.

`RoleHealer` is given to `RayRoles` by the driver and lives across global restarts (its
`RestartBook` counts them). `RayRoles` asks it, each time the driver polls its roles:

- `stale_roles()`: the watched roles whose heartbeat file (relax_hpc/ops/health.py) has not
  changed for `stale_s`; a hung (SIGSTOPped, wedged) process is one of them;
- `failed(role, problem, detail, restart)`: the `RestartBook` decides. In place: `restart()`
  runs now (the role's replacement picks up its unacked rows from the transfer queue) and the
  step goes on; a replacement that fails while it starts is the role's next failure, decided
  the same way. Global: `GlobalRestartNeeded` is raised; the driver tears every role down and
  resumes from the newest checkpoint. No restarts left: `RestartsExhausted`.

Every decision goes to `on_event` (the driver logs it, puts it into status.json and alerts the
owner: [notify] event "role_restarted").
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from relax_hpc.ops.health import (
    HealthEvent,
    RestartBook,
    StaleWatch,
    heartbeat_path,
    read_heartbeats,
)
from relax_hpc.roles.errors import (
    GlobalRestartNeeded, RestartsExhausted, RoleDiedError, RoleFailure, RoleTimeoutError, short_cause,
)
from relax_hpc.spec.schema import HealthSpec

log = logging.getLogger(__name__)

# Roles restarted in place: they only add fields to queued rows, or are one engine of several.
# Every other role (a trainer rank, rollout, ActorFwd, which receives every weight broadcast)
# is core: losing it costs a global restart.
IN_PLACE_ROLES = ("reference", "advantages")


def is_core(role: str) -> bool:
    return role not in IN_PLACE_ROLES and not role.startswith("engine_")


class RoleHealer:
    def __init__(self, cfg: HealthSpec, job_dir: str | Path,
                 on_event: Callable[[HealthEvent], None] = lambda e: None) -> None:
        self.cfg, self.job_dir, self.on_event = cfg, Path(job_dir), on_event
        self.book = RestartBook(cfg)
        self.stale = StaleWatch(cfg.stale_s)
        self.restarting: dict[str, str] = {}  # role -> state shown by status ("restarting", "dead")

    def watch(self, role: str) -> None:
        """Start the stale clock of a role that was just started (or restarted)."""
        beat = read_heartbeats(self.job_dir).get(role, {}).get("beat")
        self.stale.watch(role, beat)
        self.restarting.pop(role, None)

    def forget(self, role: str) -> None:
        self.stale.forget(role)

    def stale_roles(self) -> list[str]:
        beats = {role: record.get("beat") for role, record in read_heartbeats(self.job_dir).items()}
        return self.stale.check(beats)

    def failed(self, role: str, problem: str, detail: str = "",
               restart: Callable[[], None] | None = None) -> HealthEvent:
        """Decide about one failure of `role`; restart it in place when that is the decision and
        `restart` is given, else raise (module docstring).

        A replacement that dies (or does not answer) before `restart` returns, while it is still
        starting, is the next failure of the same role and is decided like any other: in place
        again while the role has in-place restarts left, else a global restart. So what a run
        does depends on how often a role failed, never on when in its restart it failed."""
        self.stale.forget(role)
        while True:
            event = self.book.decide(role, problem, core=is_core(role) or restart is None, detail=detail)
            log.info("health: %s", event.line())
            self.restarting[role] = "restarting" if event.action != "give_up" else "dead"
            self.on_event(event)
            if event.action == "global":
                raise GlobalRestartNeeded(event)
            if event.action == "give_up":
                raise RestartsExhausted(event)
            assert restart is not None
            try:
                restart()
                return event
            except RoleFailure:
                raise
            except (RoleDiedError, RoleTimeoutError) as error:
                problem = "died" if isinstance(error, RoleDiedError) else "stopped answering"
                detail = f"while it was being restarted in place: {short_cause(error)}"

    def replaced(self, role: str) -> None:
        """`role` (a dead rollout engine) is not coming back: another took its place (status.json
        shows it "replaced", not "restarting" for the rest of the run)."""
        self.stale.forget(role)
        self.restarting[role] = "replaced"

    def global_restart(self, role: str, problem: str, detail: str = "") -> HealthEvent:
        """A failure already known to need a global restart (a dead trainer rank, rollout, a
        broken weight broadcast): counted as a failure of `role`, reported; raises
        RestartsExhausted when none is left."""
        event = self.book.decide(role, problem, core=is_core(role), detail=detail, in_place_possible=False)
        log.info("health: %s", event.line())
        self.on_event(event)
        if event.action == "give_up":
            raise RestartsExhausted(event)
        return event

    def role_states(self) -> dict[str, dict[str, object]]:
        """Per role: "running" / "restarting" / "replaced" / "dead" and its restarts in this run
        (status.json)."""
        roles = {*self.stale.roles(), *self.restarting, *self.book.restarts_by_role}
        return {role: {"state": self.restarting.get(role, "running"),
                       "restarts": self.book.restarts_by_role.get(role, 0)} for role in sorted(roles)}

    def heartbeat_file(self, role: str) -> Path:
        return heartbeat_path(self.job_dir, role)

    def reset_after_global_restart(self) -> None:
        """Every role starts afresh: the old processes' heartbeat files are gone, no clocks run."""
        for role in self.stale.roles():
            self.stale.forget(role)
        self.restarting.clear()
