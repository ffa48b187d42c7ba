"""Role health: heartbeat files, who fell silent, and what a failure costs (in place or global).

Every role process runs a `HeartbeatWriter`: a daemon thread that rewrites
`JOBDIR/health/<role>.json` every `heartbeat_s` seconds (write-then-rename), with the role's
name, pid, host, Slurm node (null outside Slurm), a beat counter and what it is doing. The files
live in the job directory, so the driver, `relax-hpc status JOBDIR` and the fault suite read them
from any node of the job.

A role is *stale* when its beat counter has not changed for `stale_s` seconds by the reader's
own clock (`StaleWatch`): clocks of different nodes never enter, and a stopped (SIGSTOP) or
wedged process stops beating like a dead one.

`RestartBook` is the policy, a pure object the driver feeds with failures:
- a role that is not core (Reference, Advantages, a rollout engine) is restarted in place; its
  `max_in_place_restarts`-th failure in the same run is not: the run restarts globally;
- a core role (a trainer rank, rollout, ActorFwd, the weight channel) costs a global restart at
  once: the run resumes from its newest checkpoint;
- after `max_global_restarts` global restarts the next failure ends the run.
Every decision is kept as a `HealthEvent` (metrics, status, alerts).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from relax_hpc.ops.files import write_private_text
from relax_hpc.spec.schema import HealthSpec

HEALTH_DIR = "health"

Action = Literal["in_place", "global", "give_up"]


def health_dir(job_dir: str | Path) -> Path:
    return Path(job_dir) / HEALTH_DIR


def heartbeat_path(job_dir: str | Path, role: str) -> Path:
    return health_dir(job_dir) / f"{role}.json"


class HeartbeatWriter:
    """Beats for one role process: `start()` once, `stop()` at shutdown (the file stays: the
    last beat says when the role went away). `doing` is called at each beat for a short text."""

    def __init__(self, path: str | Path, role: str, interval_s: float,
                 doing: Callable[[], str] | None = None) -> None:
        self.path, self.role, self.interval_s = Path(path), role, interval_s
        self._doing = doing or (lambda: "")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.beats = 0

    def start(self) -> None:
        if self._thread is not None:
            return
        self.beat()  # at once: a role is known from its start, not one interval later
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{self.role}", daemon=True)
        self._thread.start()

    def beat(self) -> None:
        self.beats += 1
        try:
            doing = self._doing()
        except Exception as e:  # noqa: BLE001 - a heartbeat never fails its role
            doing = f"? ({type(e).__name__})"
        record = {"role": self.role, "pid": os.getpid(), "host": socket.gethostname(), "node": _slurm_node(),
                  "beat": self.beats, "time": time.time(), "doing": doing}
        try:
            write_private_text(self.path, json.dumps(record))
        except OSError:  # a full or unreachable file system: the beat is missed, the reader sees it
            pass

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.beat()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 5)


def _slurm_node() -> str | None:
    """The Slurm node this process runs on, None outside Slurm. Every process of a job step
    (Ray's workers too, started by the node's raylet) inherits SLURMD_NODENAME; it tells the
    nodes apart where several share one host (tools/dev-slurm), which the host name cannot."""
    return os.environ.get("SLURMD_NODENAME") or None


def read_heartbeats(job_dir: str | Path) -> dict[str, dict[str, Any]]:
    """Every role's last heartbeat record, by role name; unreadable files are left out."""
    found: dict[str, dict[str, Any]] = {}
    directory = health_dir(job_dir)
    if not directory.is_dir():
        return found
    for path in sorted(directory.glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and isinstance(record.get("role"), str):
            found[record["role"]] = record
    return found


class StaleWatch:
    """Which watched roles have not beaten for `stale_s`, by this process's monotonic clock.

    `watch(role)` starts the clock for a role (at its start or restart): a role that never
    writes a beat goes stale `stale_s` after that. `check(beats)` takes the current beat counters
    (from `read_heartbeats`) and returns the stale roles, oldest silence first."""

    def __init__(self, stale_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.stale_s, self._clock = stale_s, clock
        self._seen: dict[str, tuple[Any, float]] = {}  # role -> (last beat seen, when it changed)

    def watch(self, role: str, beat: Any = None) -> None:
        self._seen[role] = (beat, self._clock())

    def forget(self, role: str) -> None:
        self._seen.pop(role, None)

    def roles(self) -> list[str]:
        return list(self._seen)

    def silent_for(self, role: str) -> float:
        return self._clock() - self._seen[role][1]

    def check(self, beats: dict[str, Any]) -> list[str]:
        now = self._clock()
        stale: list[tuple[float, str]] = []
        for role, (last, since) in list(self._seen.items()):
            beat = beats.get(role, last)
            if beat != last:
                self._seen[role] = (beat, now)
            elif now - since > self.stale_s:
                stale.append((since, role))
        return [role for _, role in sorted(stale)]


@dataclass(frozen=True)
class HealthEvent:
    time: float  # unix time
    role: str
    problem: str  # "died", "stale", ...: what happened, in words
    action: Action
    detail: str = ""

    def line(self) -> str:
        what = {"in_place": "restarted in place", "global": "global restart from the newest checkpoint",
                "give_up": "no restarts left: the run fails"}[self.action]
        return f"{self.role} {self.problem}: {what}" + (f" ({self.detail})" if self.detail else "")


@dataclass
class RestartBook:
    """Counts failures per role and decides each one's cost (module docstring), under [health]'s
    `max_in_place_restarts` and `max_global_restarts`."""

    limits: HealthSpec
    clock: Callable[[], float] = time.time
    in_place: int = 0
    global_restarts: int = 0
    failures: dict[str, int] = field(default_factory=dict)  # per role, since the last global restart
    restarts_by_role: dict[str, int] = field(default_factory=dict)  # in this run, in place or global
    history: list[HealthEvent] = field(default_factory=list)  # every decision, in order

    def decide(self, role: str, problem: str, core: bool, detail: str = "",
               in_place_possible: bool = True) -> HealthEvent:
        """Record the failure of `role` and return what to do about it. `in_place_possible`:
        False for a failure that already costs a global restart whatever the count (one the
        driver met outside the health checks); it still counts as a failure of the role."""
        count = self.failures.get(role, 0) + 1
        self.failures[role] = count
        if not core and in_place_possible and count < self.limits.max_in_place_restarts:
            action: Action = "in_place"
            self.in_place += 1
        elif self.global_restarts < self.limits.max_global_restarts:
            action = "global"
            self.global_restarts += 1
            if not core and count >= self.limits.max_in_place_restarts:
                detail = (f"{detail}; " if detail else "") + f"failure {count} of this role in a row"
            self.failures.clear()  # every role starts afresh
        else:
            action = "give_up"
        if action != "give_up":
            self.restarts_by_role[role] = self.restarts_by_role.get(role, 0) + 1
        event = HealthEvent(self.clock(), role, problem, action, detail)
        self.history.append(event)
        return event

    def metrics(self) -> dict[str, float]:
        return {"health/in_place_restarts": float(self.in_place),
                "health/global_restarts": float(self.global_restarts)}

    def summary(self) -> dict[str, Any]:
        return {"in_place": self.in_place, "global": self.global_restarts,
                "events": [asdict(e) for e in self.history]}
