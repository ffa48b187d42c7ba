"""`relax-hpc status`: a local run's directory, a Slurm job's, and `--watch`."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from relax_hpc.cli.main import main
from relax_hpc.cli import slurm_commands as commands
from relax_hpc.launch.slurm_client import FakeSlurmClient, JobComponent
from relax_hpc.ops.run_status import RunStatus

REPO = Path(__file__).resolve().parents[2]


def _no_slurm() -> FakeSlurmClient:
    raise AssertionError("a local run's directory must not ask Slurm")


def _running(job_dir: Path, step: int = 3) -> RunStatus:
    status = RunStatus(job_dir, "tiny", total_steps=10)
    status.set_state("running")
    status.on_step(step, {"reward/mean": 0.5, "time/step_s": 1.0}, 64)
    return status


def test_a_local_run_directory_prints_its_status_without_slurm(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(commands, "make_client", _no_slurm)
    _running(tmp_path)
    assert main(["status", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"run tiny  ({tmp_path})\n")
    assert "3/10  reward 0.500" in out and "64.0 samples/s" in out


def test_a_directory_without_a_status_says_the_run_has_not_started(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(commands, "make_client", _no_slurm)
    assert main(["status", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "has not started yet, or this is not a job directory" in out


def test_a_slurm_job_shows_its_components_then_the_run_status(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    fake = FakeSlurmClient()
    fake.jobs["1000"] = [JobComponent("1000", 0, "RUNNING", "n1")]
    monkeypatch.setattr(commands, "make_client", lambda: fake)
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    (job_dir / "slurm_job_id").write_text("1000\n")
    _running(job_dir, step=4)
    assert main(["status", str(job_dir)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"job 1000  ({job_dir.resolve()})"
    assert any("1000" in line and "RUNNING" in line for line in lines)
    run = lines.index(f"run tiny  ({job_dir.resolve()})")  # after the Slurm lines
    assert run > 1 and "4/10" in lines[run + 2]


def test_watch_refuses_a_non_positive_interval(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", str(tmp_path), "--watch", "--every", "0"]) == 2
    assert "--every 0: pass the seconds between refreshes, > 0" in capsys.readouterr().err


def test_watch_refreshes_until_ctrl_c_and_exits_0(tmp_path: Path) -> None:
    status = _running(tmp_path)
    cmd = [sys.executable, "-m", "relax_hpc.cli.main", "status", str(tmp_path), "--watch", "--every", "0.2"]
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "RAY_AUTH_MODE": "disabled"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: list[str] = []
    updated = False
    try:
        assert proc.stdout is not None
        while not any("4/10" in line for line in seen):
            line = proc.stdout.readline()
            assert line, proc.stderr.read() if proc.stderr else ""
            seen.append(line)
            if not updated and sum(s.startswith("---- ") for s in seen) == 2 and "3/10" in line:
                status.on_step(4, {"reward/mean": 0.5, "time/step_s": 1.0}, 64)  # a later refresh shows it
                updated = True
        proc.send_signal(signal.SIGINT)
        out = proc.stdout.read()  # not communicate(): it would skip what readline() buffered
        err = proc.stderr.read() if proc.stderr else ""
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    blocks = [b for b in ("".join(seen) + out).split("---- ") if b.strip()]
    assert len(blocks) >= 3  # a pipe: each refresh starts with a time line
    assert all(b.splitlines()[1] == f"run tiny  ({tmp_path})" for b in blocks)  # each a whole status
    assert "3/10" in blocks[0] and "3/10" in blocks[1] and "4/10" in blocks[-1]  # each refresh reads anew


def test_watch_on_a_terminal_clears_the_screen_before_each_refresh(monkeypatch: pytest.MonkeyPatch) -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    screen = Terminal()
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        if len(sleeps) == 2:
            raise KeyboardInterrupt  # Ctrl-C during the second wait

    monkeypatch.setattr(sys, "stdout", screen)
    monkeypatch.setattr(commands.time, "sleep", sleep)
    refreshes = iter(["first", "second"])
    assert commands.watch(lambda: [next(refreshes)], 2.5, "relax-hpc status JOBDIR") == 0
    frames = screen.getvalue().split(commands.CLEAR_SCREEN)
    assert frames[0] == "" and len(frames) == 3 and sleeps == [2.5, 2.5]
    assert frames[1].startswith("relax-hpc status JOBDIR  (every 2.5s, Ctrl-C to stop)")
    assert frames[1].endswith("\n\nfirst\n") and frames[2].endswith("\n\nsecond\n")
    assert "----" not in screen.getvalue()
