"""The run's alerts: when each event fires (JobAlerts with the in-memory notifier), the urls_file,
and a tiny in-process run that alerts a real local endpoint through Apprise's json:// scheme."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from e2e_helpers import tiny_spec_text
from notify_endpoint import json_endpoint

from relax_hpc.driver import run as run_module
from relax_hpc.driver.alerts import (
    JobAlerts,
    newest_checkpoint,
    notify_urls,
    read_urls_file,
)
from relax_hpc.driver.run import run_job
from relax_hpc.ops.notify import InMemoryNotifier
from relax_hpc.spec import parse_spec


def alerts(env: dict[str, str] | None = None, milestones: tuple[float, ...] = (),
           reached: float | None = None) -> tuple[JobAlerts, InMemoryNotifier]:
    memory = InMemoryNotifier()
    return JobAlerts(memory, "tiny", Path("/runs/tiny"), milestones, reached, env or {}), memory


def test_started_is_requeued_after_a_slurm_restart_or_a_resume_on_slurm() -> None:
    local, memory = alerts()
    local.started(None)
    local.started(7)  # a local resume is a start
    slurm, slurm_memory = alerts({"SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": "0"})
    slurm.started(None)
    slurm.started(7)
    restarted, restarted_memory = alerts({"SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": "2"})
    restarted.started(None)
    assert [(a.event, a.title, a.body) for a in memory.sent] == [
        ("started", "relax-hpc tiny: started", "job tiny (job dir /runs/tiny): starting at step 0"),
        ("started", "relax-hpc tiny: started",
         "job tiny (job dir /runs/tiny): resuming from the checkpoint of step 7")]
    assert [(a.event, a.body) for a in slurm_memory.sent] == [
        ("started", "job tiny (Slurm job 4242, job dir /runs/tiny): starting at step 0"),
        ("requeued", "job tiny (Slurm job 4242, job dir /runs/tiny): resuming from the checkpoint of step 7")]
    assert [(a.event, a.title) for a in restarted_memory.sent] == [("requeued", "relax-hpc tiny: requeued (restart 2)")]


def test_each_reward_milestone_is_sent_once() -> None:
    job, memory = alerts(milestones=(0.5, 0.1, 0.3, 0.9), reached=0.2)  # 0.1: reached before a requeue
    for step, reward in enumerate([0.05, 0.35, 0.2, 0.6, 0.55], start=1):
        job.step(step, {"reward/mean": reward})
    job.step(6, {"other": 1.0})
    assert [(a.title, a.body) for a in memory.sent] == [
        ("relax-hpc tiny: reward/mean reached 0.3", "job tiny: reward/mean 0.3500 at step 2 reached 0.3"),
        ("relax-hpc tiny: reward/mean reached 0.5", "job tiny: reward/mean 0.6000 at step 4 reached 0.5")]
    job, memory = alerts(milestones=(0.1, 0.2))
    job.step(1, {"reward/mean": 0.25})  # two at once: one alert
    assert [a.title for a in memory.sent] == ["relax-hpc tiny: reward/mean reached 0.1, 0.2"]


def test_ended_failed_and_interrupted() -> None:
    job, memory = alerts()
    job.ended("finished step 3 (from 0) in 9 s", stopped_early=False, reason="")
    job.ended("stopped early at step 2 (from 0) in 5 s", stopped_early=True, reason="SIGUSR1")
    job.failed(RuntimeError("the trainer died\nTraceback lines"))
    job.interrupted()
    assert [(a.event, a.title) for a in memory.sent] == [
        ("finished", "relax-hpc tiny: finished"), ("preempted", "relax-hpc tiny: stopped by SIGUSR1"),
        ("failed", "relax-hpc tiny: failed: RuntimeError"), ("preempted", "relax-hpc tiny: stopped at once")]
    assert memory.sent[0].body == "job tiny finished step 3 (from 0) in 9 s"
    assert memory.sent[2].body.startswith("job tiny failed: RuntimeError: the trainer died\n")
    assert "Traceback" not in memory.sent[2].body


def test_a_failing_notifier_never_reaches_the_caller(caplog: pytest.LogCaptureFixture) -> None:
    class Broken:
        def notify(self, event: str, title: str, body: str) -> None:
            raise ConnectionError("down")

        def close(self) -> None:
            raise OSError("gone")

    job = JobAlerts(Broken(), "tiny", Path("/runs/tiny"), (0.1,))
    caplog.set_level(logging.WARNING)
    job.started(None)
    job.step(1, {"reward/mean": 0.5})
    job.ended("finished", stopped_early=False, reason="")
    job.close()
    warnings = [r.getMessage() for r in caplog.records]
    assert len([w for w in warnings if "training goes on" in w]) == 1, warnings


def test_urls_file_must_be_owner_only(tmp_path: Path) -> None:
    path = tmp_path / "alerts"
    path.write_text("# my alerts\nntfy://ntfy.sh/secret-topic\n\n  slack://A/B/C  \n")
    os.chmod(path, 0o640)
    with pytest.raises(ValueError, match=r"urls_file .* has mode 640: others could read the URLs' secrets; "
                                         r"`chmod 600` it"):
        read_urls_file(path)
    os.chmod(path, 0o600)
    assert read_urls_file(path) == ["ntfy://ntfy.sh/secret-topic", "slack://A/B/C"]
    with pytest.raises(ValueError, match="cannot read it"):
        read_urls_file(tmp_path / "missing")
    spec = parse_spec(tiny_spec_text(tmp_path, tmp_path / "job", steps=1,
                                     extra=f'[notify]\nurls = ["json://localhost/x"]\nurls_file = "{path}"\n'))
    assert notify_urls(spec) == ["json://localhost/x", "ntfy://ntfy.sh/secret-topic", "slack://A/B/C"]


def test_newest_checkpoint_follows_the_latest_pointer(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    assert newest_checkpoint(tmp_path) is None
    for step in (2, 4):
        (root / f"step_{step}").mkdir(parents=True)
    (root / "tmp_step_6").mkdir()
    assert newest_checkpoint(tmp_path) == 4
    (root / "latest").write_text("step_2")
    assert newest_checkpoint(tmp_path) == 2


def test_a_tiny_run_alerts_started_milestone_and_finished(tiny_model_dir: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    with json_endpoint() as endpoint:
        url = endpoint.url("hook-Secret123", auth="alice:pa55-secret@")
        extra = f'[notify]\nurls = ["{url}"]\nreward_milestones = [0.0]\n'
        spec = parse_spec(tiny_spec_text(tiny_model_dir, tmp_path / "job", steps=2, save_interval=2, extra=extra))
        report = run_job(spec, in_process=True, progress=False)
        posts = endpoint.wait_for(3)
    assert [p["title"] for p in posts] == ["relax-hpc e2e: started", "relax-hpc e2e: reward/mean reached 0",
                                           "relax-hpc e2e: finished"]
    assert posts[0]["message"] == f"job e2e (job dir {tmp_path / 'job'}): starting at step 0"
    assert "at step 1 reached 0" in posts[1]["message"]
    assert posts[2]["message"] == f"job e2e {report.summary_line()}"
    assert all(p["path"] == "/hook-Secret123" for p in posts)
    written = (tmp_path / "job" / "spec.toml").read_text()
    printed = capsys.readouterr()
    for secret in ("pa55-secret", "hook-Secret123", "alice"):
        assert secret not in written and secret not in printed.out + printed.err
    assert f"json://***@127.0.0.1:{endpoint.port}/***" in written


def test_a_failing_run_alerts_failed_and_raises(tiny_model_dir: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: object) -> None:
        raise RuntimeError("the trainer died\nmore detail")

    monkeypatch.setattr(run_module, "run_authenticated", boom)
    with json_endpoint() as endpoint:
        spec = parse_spec(tiny_spec_text(tiny_model_dir, tmp_path / "job", steps=2,
                                         extra=f'[notify]\nurls = ["{endpoint.url()}"]\n'))
        with pytest.raises(RuntimeError, match="the trainer died"):
            run_job(spec, in_process=True, progress=False)
        posts = endpoint.wait_for(2)
    assert [p["title"] for p in posts] == ["relax-hpc e2e: started", "relax-hpc e2e: failed: RuntimeError"]
    assert posts[1]["message"].startswith("job e2e failed: RuntimeError: the trainer died\n")


def test_a_run_stopped_by_a_signal_alerts_preempted(tiny_model_dir: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    def usr1_at_once(stop: run_module.StopFlag) -> None:  # as if Slurm sent USR1 before the time limit
        stop.requested, stop.reason = True, "SIGUSR1"

    monkeypatch.setattr(run_module, "install_stop_handlers", usr1_at_once)
    with json_endpoint() as endpoint:
        spec = parse_spec(tiny_spec_text(tiny_model_dir, tmp_path / "job", steps=5,
                                         extra=f'[notify]\nurls = ["{endpoint.url()}"]\n'))
        report = run_job(spec, in_process=True, progress=False)
        posts = endpoint.wait_for(2)
    assert report.result.stopped_early
    assert [p["title"] for p in posts] == ["relax-hpc e2e: started", "relax-hpc e2e: stopped by SIGUSR1"]
    assert posts[1]["message"].startswith(f"job e2e {report.summary_line()}")
