"""What a run tells its owner, and when ([notify]; docs/operations.md, "Alerts").

relax_hpc/driver/run.py calls, in order: ``check_notify`` before anything starts (a URL Apprise
refuses, or a urls_file others can read, stops the run there), ``make_job_alerts`` once the job
directory is locked, then ``started`` (sent as ``requeued`` on a Slurm restart or a resume on
Slurm), ``step`` after every step (``reward_milestone``), and ``ended`` (``finished`` or
``preempted``) or ``failed``, and ``close``. Past ``check_notify`` nothing here raises: an alert
that cannot be built or sent is logged, and training goes on.
"""

from __future__ import annotations

import logging
import os
import stat
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from relax_hpc.ckpt.layout import LATEST_FILE, list_root, load_order, parse_latest
from relax_hpc.ops.metrics import read_metrics
from relax_hpc.ops.notify import (
    Notifier,
    NullNotifier,
    check_urls,
    make_notifier,
    redact_url,
)
from relax_hpc.spec import JobSpec

__all__ = ["JobAlerts", "check_notify", "make_job_alerts", "newest_checkpoint", "notify_urls", "read_urls_file"]

log = logging.getLogger(__name__)

# An exception's first line is cut here in a "failed" alert; the job's log has the rest.
_MAX_ERROR_CHARS = 300


def read_urls_file(path: Path) -> list[str]:
    """The URLs of a [notify] urls_file: one a line, blank lines and "#" comments skipped.
    ValueError when it cannot be read or group or others can read it."""
    path = path.expanduser()
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"[notify] urls_file {path}: cannot read it ({exc}); write one Apprise URL a line "
                         "and `chmod 600` it") from None
    if mode & 0o077:
        raise ValueError(f"[notify] urls_file {path} has mode {mode:o}: others could read the URLs' secrets; "
                         "`chmod 600` it")
    lines = (line.strip() for line in text.splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def notify_urls(spec: JobSpec) -> list[str]:
    """[notify] urls and the URLs of urls_file, in that order."""
    urls = list(spec.notify.urls)
    if spec.notify.urls_file is not None:
        urls += read_urls_file(Path(spec.notify.urls_file))
    return urls


def check_notify(spec: JobSpec) -> None:
    """ValueError naming every [notify] URL that cannot be used (redacted), before the run starts."""
    problems = check_urls(notify_urls(spec))
    if problems:
        raise ValueError("\n".join(problems))


def newest_checkpoint(job_dir: Path) -> int | None:
    """The step of the checkpoint a resuming run loads first (the loop skips a damaged one)."""
    root = job_dir / "checkpoints"
    latest = root / LATEST_FILE
    pointer = parse_latest(latest.read_text(encoding="utf-8")) if latest.is_file() else None
    order = load_order(pointer, list_root(root).steps)
    return order[0] if order else None


class JobAlerts:
    """The alerts of one run, sent through ``notifier``; never raises."""

    def __init__(self, notifier: Notifier, job_name: str, job_dir: Path, milestones: Sequence[float] = (),
                 reached: float | None = None, env: Mapping[str, str] | None = None) -> None:
        self.notifier = notifier
        self.job_name = job_name
        self.job_dir = job_dir
        # Milestones an earlier attempt of the job already reached (metrics.jsonl) are not sent again.
        self.milestones = sorted(m for m in milestones if reached is None or m > reached)
        self.env = os.environ if env is None else env
        self._warned = False

    def send(self, event: str, what: str, body: str) -> None:
        try:
            self.notifier.notify(event, f"relax-hpc {self.job_name}: {what}", body)
        except Exception as exc:  # noqa: BLE001 - an alert never stops training
            if not self._warned:
                self._warned = True
                log.warning("notify: the '%s' alert failed (%s); training goes on", event, type(exc).__name__)

    def started(self, resume_from: int | None) -> None:
        slurm_job = self.env.get("SLURM_JOB_ID")
        restarts = self.env.get("SLURM_RESTART_COUNT", "0")
        restart_count = int(restarts) if restarts.isdigit() else 0
        where = f"Slurm job {slurm_job}, " if slurm_job else ""
        start = (f"resuming from the checkpoint of step {resume_from}" if resume_from is not None
                 else "starting at step 0")
        body = f"job {self.job_name} ({where}job dir {self.job_dir}): {start}"
        if restart_count > 0 or (slurm_job and resume_from is not None):
            self.send("requeued", f"requeued (restart {restart_count})", body)
        else:
            self.send("started", "started", body)

    def step(self, step: int, metrics: Mapping[str, float]) -> None:
        reward = metrics.get("reward/mean")
        if reward is None or not self.milestones or reward < self.milestones[0]:
            return
        reached = [m for m in self.milestones if reward >= m]
        self.milestones = self.milestones[len(reached):]
        shown = ", ".join(f"{m:g}" for m in reached)
        self.send("reward_milestone", f"reward/mean reached {shown}",
                  f"job {self.job_name}: reward/mean {reward:.4f} at step {step} reached {shown}")

    def ended(self, summary: str, stopped_early: bool, reason: str) -> None:
        if stopped_early:
            self.send("preempted", f"stopped by {reason or 'a stop signal'}",
                      f"job {self.job_name} {summary} (checkpoint written: the job resumes from it when it "
                      "starts again; on Slurm [cluster] requeue does that)")
        else:
            self.send("finished", "finished", f"job {self.job_name} {summary}")

    def role_restarted(self, line: str) -> None:
        """A role died or hung and was restarted (in place or globally; relax_hpc/ops/health.py)."""
        self.send("role_restarted", line.split(":")[0], f"job {self.job_name}: {line}; job dir {self.job_dir}")

    def save_failed(self, line: str) -> None:
        """A checkpoint save failed on its storage; the run goes on (driver/checkpointing.py)."""
        self.send("save_failed", "a checkpoint save failed", f"job {self.job_name}: {line}; training goes on, the "
                  f"next save tries again; job dir {self.job_dir}")

    def interrupted(self) -> None:
        self.send("preempted", "stopped at once",
                  f"job {self.job_name} was stopped at once (a second stop signal): no final checkpoint; "
                  f"job dir {self.job_dir}")

    def failed(self, error: BaseException) -> None:
        lines = str(error).strip().splitlines()
        first = lines[0][:_MAX_ERROR_CHARS] if lines else ""
        self.send("failed", f"failed: {type(error).__name__}",
                  f"job {self.job_name} failed: {type(error).__name__}: {first}\njob dir {self.job_dir} "
                  "(the job's log has the traceback)")

    def close(self) -> None:
        try:
            self.notifier.close()
        except Exception as exc:  # noqa: BLE001
            log.warning("notify: closing the notifier failed (%s)", type(exc).__name__)


def _reward_reached(job_dir: Path) -> float | None:
    """The highest reward/mean an earlier attempt of this job logged (metrics.jsonl), if any."""
    try:
        rewards = [row["reward/mean"] for row in read_metrics(job_dir / "metrics.jsonl") if "reward/mean" in row]
    except (OSError, ValueError, KeyError):
        return None
    return max(rewards) if rewards else None


def make_job_alerts(spec: JobSpec, job_dir: Path) -> JobAlerts:
    """The run's alerts from [notify]; a notifier that cannot be built is logged and left out."""
    n = spec.notify
    notifier: Notifier = NullNotifier()
    try:
        urls = notify_urls(spec)
        notifier = make_notifier(urls, n.events, n.min_interval_s)
    except Exception as exc:  # noqa: BLE001 - check_notify reported the causes before the run started
        log.warning("notify: no alerts for this run (%s)", str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        urls = []
    if urls:
        print(f"alerts ({', '.join(n.events)}) to {', '.join(redact_url(u) for u in urls)}", file=sys.stderr)
    reached = _reward_reached(job_dir) if n.reward_milestones and "reward_milestone" in n.events else None
    return JobAlerts(notifier, spec.job.name, job_dir, n.reward_milestones, reached)
