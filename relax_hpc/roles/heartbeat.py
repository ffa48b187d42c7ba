"""`Heartbeats`: the mixin that makes a role's process beat (relax_hpc/ops/health.py).

Every role class the driver places as a Ray actor inherits it; the driver calls
`start_heartbeat(job_dir, role, interval_s)` once the actor is up. The beat runs on a daemon
thread of its own, so a role busy in a long call still beats, and one that is stopped
(SIGSTOP) or dead does not: that is what the driver's stale check looks for.
"""

from __future__ import annotations

import os

from relax_hpc.ops.health import HeartbeatWriter, heartbeat_path


class Heartbeats:
    """Mixin: `start_heartbeat` / `stop_heartbeat`; subclasses may override `doing()`."""

    _heartbeat: HeartbeatWriter | None = None

    def start_heartbeat(self, job_dir: str, role: str, interval_s: float) -> int:
        """Beat into JOBDIR/health/<role>.json every `interval_s`; returns this process's pid."""
        if self._heartbeat is None:
            self._heartbeat = HeartbeatWriter(heartbeat_path(job_dir, role), role, interval_s, self.doing)
            self._heartbeat.start()
        return os.getpid()

    def stop_heartbeat(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None

    def doing(self) -> str:
        """A few words on what the role does now, shown by `relax-hpc status`."""
        return ""
