"""The Slurm subcommands of `relax-hpc` through main(), with the fake Slurm client."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from relax_hpc.cli.main import main
from relax_hpc.driver.jobdir import JobDirLock
from relax_hpc.cli import slurm_commands as commands
from relax_hpc.launch.slurm_client import FakeSlurmClient, JobComponent

REPO = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).parent / "golden"


def test_render_prints_the_script(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["render", str(REPO / "jobspecs/tiny_slurm.toml"), "--job-dir", "/shared/runs/tiny_slurm"]) == 0
    assert capsys.readouterr().out == (GOLDEN / "tiny_slurm.sbatch").read_text()


def test_submit_status_cancel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                              capsys: pytest.CaptureFixture[str]) -> None:
    fake = FakeSlurmClient(node_records=[{"name": f"n{i}", "cpus": 2, "gres": "", "partitions": ["debug"]}
                                         for i in range(2)])
    monkeypatch.setattr(commands, "make_client", lambda: fake)
    spec = tmp_path / "s.toml"
    spec.write_text((REPO / "jobspecs/tiny_slurm.toml").read_text().replace(
        'name = "tiny_slurm"', f'name = "s"\noutput_dir = "{tmp_path / "job"}"'))
    assert main(["submit", str(spec)]) == 0
    out = capsys.readouterr().out
    assert "submitted job 1000" in out and "relax-hpc status 1000" in out
    fake.jobs["1000"] = [JobComponent("1000", 0, "RUNNING", "n1"), JobComponent("1001", 1, "PENDING", "")]
    assert main(["status", str(tmp_path / "job")]) == 0
    out = capsys.readouterr().out
    assert "trainer  1000" in out and "rollout  1001" in out and "PENDING" in out
    assert main(["cancel", str(tmp_path / "job"), "--checkpoint"]) == 0
    assert fake.actions[-1] == ("cancel", "1000", "USR1", "batch")
    assert main(["cancel", str(tmp_path / "job"), "--stop"]) == 0
    assert fake.actions[-1] == ("cancel", "1000", "USR2", "batch")
    assert "checkpoint and end" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # one or the other
        main(["cancel", str(tmp_path / "job"), "--stop", "--checkpoint"])


def test_submit_refuses_a_spec_the_partition_cannot_hold(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    fake = FakeSlurmClient(node_records=[{"name": "g1", "cpus": 64, "gres": "gpu:4", "partitions": ["gpu"]}])
    monkeypatch.setattr(commands, "make_client", lambda: fake)
    assert main(["submit", str(REPO / "jobspecs/qwen3_omni.toml")]) == 2
    err = capsys.readouterr().err
    assert "cluster.trainer.gpus_per_node = 8" in err and "at most 4 GPU" in err
    assert fake.submitted == []


def test_submit_while_a_run_holds_the_job_dir_is_one_line_and_exit_2(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    fake = FakeSlurmClient(node_records=[{"name": f"n{i}", "cpus": 2, "gres": "", "partitions": ["debug"]}
                                         for i in range(2)])
    monkeypatch.setattr(commands, "make_client", lambda: fake)
    spec = tmp_path / "s.toml"
    spec.write_text((REPO / "jobspecs/tiny_slurm.toml").read_text().replace(
        'name = "tiny_slurm"', f'name = "s"\noutput_dir = "{tmp_path / "job"}"'))
    with JobDirLock(tmp_path / "job"):
        assert main(["submit", str(spec)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"relax-hpc submit: job directory {tmp_path / 'job'} is in use")
    assert f"pid {os.getpid()} on host " in err and fake.submitted == []


def test_status_of_an_unknown_job_argument(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "not-a-job"]) == 2
    assert "expected a Slurm job id" in capsys.readouterr().err
