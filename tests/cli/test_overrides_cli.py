"""Several spec files and --set KEY=VALUE on the command line: every command that reads a spec
takes them, errors exit 2 naming the --set, `show` says where each value came from, and a run
and a submission use (and record) the overridden values."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from relax_hpc.cli.main import main
from relax_hpc.cli import slurm_commands as commands
from relax_hpc.launch.slurm_client import FakeSlurmClient

REPO = Path(__file__).resolve().parents[2]
TINY_SLURM = REPO / "jobspecs/tiny_slurm.toml"


def relax(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    return subprocess.run([sys.executable, "-m", "relax_hpc.cli.main", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_validate_exits_2_naming_the_set() -> None:
    result = relax("validate", "jobspecs/tiny_local.toml", "--set", "train.lr=abc", "--set", "rollout.n=4",
                   "--set", "train.steps")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    err = result.stderr
    assert "--set train.steps: no '=' between the key and the value; expected --set KEY=VALUE" in err
    # A malformed --set is reported before the spec is read; the others once it is well-formed.
    result = relax("validate", "jobspecs/tiny_local.toml", "--set", "train.lr=abc", "--set", "rollout.n=4")
    err = result.stderr
    assert result.returncode == 2
    assert "--set train.lr=abc: train.lr = 'abc': expected a number, got a string" in err
    assert "--set rollout.n=4: rollout.n = 4: unknown key (rollout.n is verl's name; ours is " \
           "rollout.n_samples_per_prompt)" in err


def test_show_composes_files_and_sets_and_says_where_each_value_came_from(tmp_path: Path) -> None:
    overlay = tmp_path / "overlay.toml"
    overlay.write_text("# more engines\n[rollout]\nnum_engines = 2\n")
    result = relax("show", "jobspecs/tiny_local.toml", str(overlay), "--set", "train.steps=2",
                   "--set", "rollout.n_samples_per_prompt=4")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "steps = 2  # --set" in lines and "n_samples_per_prompt = 4  # --set" in lines
    assert f"num_engines = 2  # {overlay}:3" in lines
    assert "lr = 0.0005  # jobspecs/tiny_local.toml:33" in lines  # the base file's line
    assert "top_p = 1.0" in lines  # a default: no note
    resolved = tomllib.loads(result.stdout)  # the notes are TOML comments: `show > my.toml` still loads
    assert resolved["rollout"]["num_engines"] == 2 and resolved["train"]["steps"] == 2


def test_render_and_submit_take_the_overrides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    overlay = tmp_path / "overlay.toml"
    overlay.write_text(f'[job]\nname = "s"\noutput_dir = "{tmp_path / "job"}"\n')
    assert main(["render", str(TINY_SLURM), str(overlay), "--set", "cluster.trainer.time=02:00:00"]) == 0
    script = capsys.readouterr().out
    assert "#SBATCH --time=02:00:00" in script and f"{tmp_path / 'job'}/spec.submit.toml" in script

    fake = FakeSlurmClient(node_records=[{"name": f"n{i}", "cpus": 2, "gres": "", "partitions": ["debug"]}
                                         for i in range(2)])
    monkeypatch.setattr(commands, "make_client", lambda: fake)
    assert main(["submit", str(TINY_SLURM), str(overlay), "--set", "train.steps=3"]) == 0
    assert "submitted job 1000: s" in capsys.readouterr().out
    job = tmp_path / "job"
    submitted = tomllib.loads((job / "spec.submit.toml").read_text())  # what the job runs
    assert submitted["train"]["steps"] == 3 and submitted["job"]["name"] == "s"
    original = (job / "spec.original.toml").read_text()
    assert TINY_SLURM.read_text() in original and overlay.read_text() in original
    assert "# --set train.steps=3" in original


@pytest.mark.parametrize("command", ["run", "validate", "show", "render", "submit", "rehearse"])
def test_every_spec_command_refuses_a_bad_set_with_exit_2(command: str, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(commands, "make_client", lambda: FakeSlurmClient())  # submit never reaches it
    assert main([command, "tiny_slurm", "--set", "cluster.trainer=2"]) == 2
    err = capsys.readouterr().err
    assert "--set cluster.trainer=2: cluster.trainer = 2: cluster.trainer is a table" in err


def test_run_with_sets_trains_and_records_them(tiny_model_dir: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)  # jobspecs/tiny_local.toml is not a file here: the embedded spec is used
    job = tmp_path / "job"
    assert main(["run", "jobspecs/tiny_local.toml", "--set", "train.steps=2", "--set", "rollout.n_samples_per_prompt=4",
                 "--set", f"model.path={tiny_model_dir}", "--set", f"job.output_dir={job}",
                 "--set", "metrics.tensorboard=false", "--set", "metrics.plot=false",
                 "--set", "metrics.trajectory_archive=false", "--in-process", "--no-progress"]) == 0
    capsys.readouterr()
    recorded = tomllib.loads((job / "spec.toml").read_text())  # the job directory's record of the run
    assert recorded["train"]["steps"] == 2 and recorded["rollout"]["n_samples_per_prompt"] == 4
    assert recorded["train"]["lr"] == 5e-4  # the file's value, under the overrides
    metrics = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    summary = json.loads((job / "summary.json").read_text())
    assert summary["samples_trained"] == 2 * 8 * 4, summary  # 2 steps x 8 prompts x 4 samples
