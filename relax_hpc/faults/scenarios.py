"""How each fault of the suite is injected into a live `relax-hpc run`, and what it left behind.

Every scenario starts the run (relax_hpc/faults/process.py), waits until it has trained
`inject_after` steps, injects its fault, waits for the run to end and ends whatever the run
left. It returns an `Injection`: what was done and when, which relax_hpc/faults/fault.py turns
into a row of the table. A scenario never raises for what the run did; only for a bug of its own.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from relax_hpc.ckpt.layout import step_dir_name
from relax_hpc.faults.inject import (
    MountError,
    SmallFilesystem,
    corrupt_checkpoint,
    latest_step,
    newest_and_previous,
    small_fs_bytes,
)
from relax_hpc.faults.process import (
    POLL_S,
    JobProcess,
    MetricsTail,
    WaitResult,
    log_tail,
)
from relax_hpc.ops.run_status import STATUS_FILE

HEARTBEAT_WAIT_S = 30.0  # for a role's heartbeat file, once the run trains (a replacement loads its model first)
SAVE_FAILURES = "ckpt/save_failures"  # the metric a failed (non-fatal) save counts in


@dataclass
class Injection:
    """What one fault's scenario did."""

    injected: bool = False
    not_run: str = ""  # why the fault could not be tried here (no privilege): no verdict
    exit_codes: list[int | None] = field(default_factory=list)  # each run; None: killed at its deadline
    rerun: bool = False  # the run was started again after the fault (a requeue)
    injected_at: float | None = None  # time.monotonic()
    first_after: int = 0  # index of the first metrics record that may show recovery
    in_flight: int | None = None  # the step in flight at the injection: its record shows nothing
    expect_start_step: int | None = None  # the checkpoint the rerun must resume from
    last_run_started: float = 0.0  # time.time(): a summary.json older than this is an earlier run's
    last_log_line: str = ""  # of the run log, when the last run failed
    problems: list[str] = field(default_factory=list)  # fault-specific checks that failed
    notes: list[str] = field(default_factory=list)  # what was done, for the row's note


@dataclass
class FaultJob:
    """One fault's job directory and the `relax-hpc run` of its spec."""

    spec_path: Path
    job_dir: Path
    inject_after: int  # steps trained before the fault
    timeout_s: float  # per run of the spec
    env: Mapping[str, str]
    tail: MetricsTail = field(init=False)

    def __post_init__(self) -> None:
        self.tail = MetricsTail(self.job_dir / "metrics.jsonl")
        self.log_path = self.job_dir / "fault.log"
        self._deadline = 0.0

    def start(self, injection: Injection) -> JobProcess:
        command = [sys.executable, "-m", "relax_hpc.cli.main", "run", str(self.spec_path), "--no-progress"]
        run = JobProcess(command, self.log_path, self.env)
        injection.last_run_started = run.started_at
        self.renew_deadline()
        return run

    def renew_deadline(self) -> None:
        """`timeout_s` from now: for a run, and in a chain again for each next fault."""
        self._deadline = time.monotonic() + self.timeout_s

    def wait(self, run: JobProcess, injection: Injection, ready: Callable[[], bool], what: str) -> bool:
        """Wait for `ready()`; on an exit or the deadline first, record why and return False."""
        result: WaitResult = run.wait_until(ready, self.tail, self._deadline)
        if result == "ok":
            return True
        if result == "timeout":
            run.kill_all()
            injection.exit_codes.append(None)
            injection.problems.append(f"timed out after {self.timeout_s:.0f} s waiting for {what} "
                                      f"(last step {self.tail.last_step()}); the run was killed")
        else:
            code = run.exit_code()
            injection.exit_codes.append(code)
            injection.problems.append(f"the run ended (exit {code}) before {what}: {log_tail(self.log_path)}")
        return False

    def reach_step(self, run: JobProcess, injection: Injection) -> bool:
        return self.wait(run, injection, lambda: self.tail.last_step() >= self.inject_after,
                         f"step {self.inject_after}")

    def wait_exit(self, run: JobProcess, injection: Injection) -> int | None:
        code = run.wait_exit(self.tail, self._deadline)
        injection.exit_codes.append(code)
        if code is None:
            injection.problems.append(f"timed out after {self.timeout_s:.0f} s (last step "
                                      f"{self.tail.last_step()}); the run was killed")
        elif code != 0:
            injection.last_log_line = log_tail(self.log_path)
        return code

    def mark(self, injection: Injection, rerun: bool = False) -> None:
        """The fault happens now: later records may show the run recovered."""
        self.tail.poll()
        injection.injected, injection.rerun = True, rerun
        injection.injected_at = time.monotonic()
        injection.first_after = len(self.tail.records)
        injection.in_flight = None if rerun else self.tail.last_step() + 1

    def finish(self, run: JobProcess, injection: Injection) -> None:
        left = run.finish()
        if left:
            injection.problems.append(f"processes {left} of the run survived SIGKILL")

    def _role_status(self, role: str) -> dict[str, object]:
        try:
            status = json.loads((self.job_dir / STATUS_FILE).read_text())
        except (OSError, ValueError):
            return {}
        info = status.get("roles", {}).get(role) if isinstance(status, dict) else None
        return info if isinstance(info, dict) else {}

    def role_back_at_work(self, role: str, restarts: int) -> bool:
        """Whether the run's status.json shows `role` running after `restarts` restarts: its
        replacement started, and the driver finished restarting it (relax_hpc/ops/run_status.py)."""
        info = self._role_status(role)
        return info.get("state") == "running" and info.get("restarts") == restarts

    def active_engines(self) -> int:
        """The rollout engines status.json shows active and alive (its report is a few seconds old)."""
        try:
            status = json.loads((self.job_dir / STATUS_FILE).read_text())
        except (OSError, ValueError):
            return 0
        engines = status.get("engines", []) if isinstance(status, dict) else []
        return sum(1 for e in engines if isinstance(e, dict) and e.get("state") == "active" and e.get("alive"))

    def role_restarts(self, role: str) -> int:
        """The restarts of `role` so far in this run of the driver (status.json; 0 before any)."""
        restarts = self._role_status(role).get("restarts", 0)
        return restarts if isinstance(restarts, int) else 0

    def role_pid(self, run: JobProcess, role: str, injection: Injection, not_these: Sequence[int] = ()) -> int | None:
        """The pid in the role's heartbeat file, once it is a live process of this run and not one
        of `not_these` (processes signalled before, which may not have exited yet)."""
        from relax_hpc.ops.health import heartbeat_path, read_heartbeats

        path = heartbeat_path(self.job_dir, role)
        deadline = time.monotonic() + HEARTBEAT_WAIT_S
        while True:
            record = read_heartbeats(self.job_dir).get(role)
            pid = record.get("pid") if record else None
            if (isinstance(pid, int) and pid not in not_these and record and record.get("host") == socket.gethostname()
                    and run.owns(pid)):
                return pid
            if time.monotonic() > deadline or run.exit_code() is not None:
                seen = f"it names pid {pid}, not a process of this run" if record else "there is none"
                injection.problems.append(f"no heartbeat of role {role} to find its process ({path}: {seen}); "
                                          "the run's roles must write JOBDIR/health/<role>.json")
                return None
            time.sleep(POLL_S)


def signal_role(job: FaultJob, run: JobProcess, injection: Injection, role: str, sig: signal.Signals,
                times: int, signalled: list[int]) -> bool:
    """Send `sig` to one role's process of a live run, `times` times in a row (each time to the
    process that replaced the last one); the pids signalled go into `signalled`. False when the
    fault could not be injected (said in `injection`; the run is then killed)."""
    base = job.role_restarts(role)
    for k in range(times):
        # The next signal goes to a replacement that is back at work (the driver finished
        # restarting it in place), never to one still starting: the run's answer to the
        # scenario is then a function of the scenario, not of the machine's speed.
        if k > 0 and not job.wait(run, injection, lambda: job.role_back_at_work(role, base + k),
                                  f"{role}'s replacement {k} back at work (status.json)"):
            return False
        pid = job.role_pid(run, role, injection, signalled)  # after a kill: the replacement
        if pid is None:
            run.kill_all()
            injection.exit_codes.append(None)
            return False
        job.mark(injection)
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            injection.injected = False
            injection.problems.append(f"{role} (pid {pid}) exited by itself before the {sig.name}")
            run.kill_all()
            injection.exit_codes.append(None)
            return False
        signalled.append(pid)
    pids = ", ".join(str(p) for p in signalled[-times:])
    injection.notes.append(f"{sig.name} to {role} (pid {pids}) after step {job.tail.last_step()}")
    return True


def continue_stopped(run: JobProcess, signalled: Sequence[int]) -> None:
    """SIGCONT to the processes a hang fault stopped that are still there: never leave a stopped
    process behind."""
    for pid in signalled:
        if run.owns(pid):
            os.kill(pid, signal.SIGCONT)


def role_fault(job: FaultJob, role: str, sig: signal.Signals, times: int = 1) -> Injection:
    """Send `sig` to one role's process mid-run, `times` times in a row (signal_role); with
    SIGSTOP it is continued once the run is over. The time to recover counts from the last signal."""
    injection = Injection()
    run = job.start(injection)
    signalled: list[int] = []
    try:
        if job.reach_step(run, injection) and signal_role(job, run, injection, role, sig, times, signalled):
            job.wait_exit(run, injection)
    finally:
        if sig == signal.SIGSTOP:
            continue_stopped(run, signalled)
        job.finish(run, injection)
    return injection


def kill_driver_and_start_again(job: FaultJob, run: JobProcess, injection: Injection) -> JobProcess | None:
    """SIGKILL the driver of a live run and every process it started, then start the run again
    (a requeue): the new run, or None when the killed one left processes behind."""
    step = job.tail.last_step()
    killed_at = time.monotonic()
    left = run.kill_all()
    injection.exit_codes.append(run.exit_code())
    job.finish(run, injection)
    if left:
        injection.problems.append(f"processes {left} of the killed run survived SIGKILL")
        return None
    job.mark(injection, rerun=True)  # the killed run's last records are read by now
    injection.injected_at = killed_at
    injection.notes.append(f"SIGKILL to the driver and all its processes after step {step}; started again")
    return job.start(injection)


def stop_corrupt_and_start_again(job: FaultJob, run: JobProcess, injection: Injection) -> JobProcess | None:
    """Stop a live run (SIGTERM: it checkpoints), truncate its newest checkpoint, start it again:
    it must resume from the checkpoint before. The new run, or None when that could not be done."""
    run.signal_driver(signal.SIGTERM)
    try:
        code = job.wait_exit(run, injection)
    finally:
        job.finish(run, injection)
    if code is None:
        return None  # timed out: said by wait_exit
    if code != 0:
        injection.problems.append(f"the run stopped by SIGTERM exited {code}, not 0 (it finishes the step, "
                                  f"checkpoints and stops): {injection.last_log_line}")
        return None
    root = job.job_dir / "checkpoints"
    pair = newest_and_previous(root)
    if pair is None:
        injection.problems.append(f"fewer than two complete checkpoints in {root} after the stop: nothing "
                                  "older to resume from ([checkpoint] save_interval, keep_last)")
        return None
    newest, previous = pair
    damaged = corrupt_checkpoint(root / step_dir_name(newest))
    job.mark(injection, rerun=True)
    injection.expect_start_step = previous
    injection.notes.append(f"stopped at step {job.tail.last_step()}, truncated {step_dir_name(newest)}/"
                           f"{damaged.name}; started again")
    return job.start(injection)


def _then_run_to_end(job: FaultJob, injection: Injection,
                     inject: Callable[[FaultJob, JobProcess, Injection], JobProcess | None]) -> Injection:
    run = job.start(injection)
    try:
        if not job.reach_step(run, injection):
            job.finish(run, injection)
            return injection
        again = inject(job, run, injection)
    except BaseException:
        job.finish(run, injection)
        raise
    if again is not None:
        try:
            job.wait_exit(again, injection)
        finally:
            job.finish(again, injection)
    return injection


def driver_kill(job: FaultJob) -> Injection:
    """SIGKILL the driver and every process it started, then start the run again (a requeue)."""
    return _then_run_to_end(job, Injection(), kill_driver_and_start_again)


def corrupt_newest_checkpoint(job: FaultJob) -> Injection:
    """Stop the run (SIGTERM: it checkpoints), truncate its newest checkpoint, start it again:
    it must resume from the checkpoint before."""
    return _then_run_to_end(job, Injection(), stop_corrupt_and_start_again)


def disk_full(job: FaultJob, model_path: Path, keep_last: int) -> Injection:
    """JOBDIR/checkpoints on a small tmpfs, filled up after the first save: the next save fails,
    the run goes on; the ballast is removed once the failure shows in metrics.jsonl, so a later
    save (and the last) succeed."""
    injection = Injection()
    root = job.job_dir / "checkpoints"
    disk = SmallFilesystem(root, small_fs_bytes(model_path, keep_last))
    try:
        disk.mount()
    except MountError as e:
        injection.not_run = f"not run ({e})"
        return injection
    try:
        run = job.start(injection)
        try:
            if not job.wait(run, injection, lambda: (latest_step(root) or 0) >= 1, "the first checkpoint"):
                return injection
            saved = latest_step(root)
            job.mark(injection)
            written = disk.fill()
            injection.notes.append(f"filled the {disk.size_bytes >> 20} MiB file system of {root.name}/ "
                                   f"({written >> 20} MiB of ballast) after the save of step {saved}")
            if not job.wait(run, injection, lambda: job.tail.max_scalar(SAVE_FAILURES) >= 1,
                            f"a failed save ({SAVE_FAILURES} in metrics.jsonl)"):
                return injection
            disk.free()
            failed_at = next(r.step for r in job.tail.records if float(r.scalars.get(SAVE_FAILURES, 0)) >= 1)
            injection.notes.append(f"a save failed (seen at step {failed_at}); ballast removed")
            job.wait_exit(run, injection)
        finally:
            disk.free()
            job.finish(run, injection)  # before unmounting: nothing of the run may hold it
    finally:
        disk.unmount()
    return injection
