"""`relax-hpc submit --dry-run` with the fake Slurm client: the submission's checks, Slurm's answer
for the rendered script, and nothing written or submitted. tests/slurm/test_dev_slurm_dry_run.py asks
the real (local) Slurm."""

from __future__ import annotations

from pathlib import Path

import pytest

from relax_hpc.cli.main import main
from relax_hpc.cli import slurm_commands as commands
from relax_hpc.launch.slurm_client import FakeSlurmClient, JobComponent, SlurmError, SubprocessSlurmClient

REPO = Path(__file__).resolve().parents[2]


def _spec(tmp_path: Path) -> Path:
    spec = tmp_path / "s.toml"
    spec.write_text((REPO / "jobspecs/tiny_slurm.toml").read_text().replace(
        'name = "tiny_slurm"', f'name = "s"\noutput_dir = "{tmp_path / "job"}"'))
    return spec


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*"))


def _fake() -> FakeSlurmClient:
    return FakeSlurmClient(node_records=[{"name": f"n{i}", "cpus": 2, "gres": "", "partitions": ["debug"]}
                                         for i in range(2)])


def test_a_dry_run_prints_slurms_answer_and_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    fake = _fake()
    monkeypatch.setattr(commands, "make_client", lambda: fake)
    monkeypatch.chdir(tmp_path)
    spec = _spec(tmp_path)
    before = _files(tmp_path)
    assert main(["submit", str(spec), "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    # The fake answers with the number of hetjob components it was given: the whole job, one script.
    assert out[0] == "sbatch: Job 1000 to start now using 2 component(s) (fake Slurm, nothing submitted)"
    assert out[1].startswith("dry run: nothing was submitted or written")
    assert _files(tmp_path) == before and not (tmp_path / "job").exists()
    assert fake.submitted == [] and fake.actions == [("test_only", str(tmp_path))]


def test_a_dry_run_makes_the_submissions_checks_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    small = FakeSlurmClient(node_records=[{"name": "g1", "cpus": 64, "gres": "gpu:4", "partitions": ["gpu"]}])
    monkeypatch.setattr(commands, "make_client", lambda: small)
    assert main(["submit", str(REPO / "jobspecs/qwen3_omni.toml"), "--dry-run"]) == 2
    assert "at most 4 GPU" in capsys.readouterr().err and small.actions == []

    fake = _fake()  # the job directory's last job is still queued: the submission would refuse
    monkeypatch.setattr(commands, "make_client", lambda: fake)
    spec = _spec(tmp_path)
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "slurm_job_id").write_text("900\n")
    fake.jobs["900"] = [JobComponent("900", 0, "RUNNING", "n1")]
    assert main(["submit", str(spec), "--dry-run"]) == 2
    assert "belongs to Slurm job 900, still RUNNING" in capsys.readouterr().err
    assert fake.actions == [] and _files(tmp_path / "job") == [tmp_path / "job" / "slurm_job_id"]


def test_slurms_refusal_is_one_line_and_exit_1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    fake = _fake()

    def refuse(script_text: str, cwd: Path, env: object) -> str:
        raise SlurmError("sbatch --test-only exited 1: sbatch: error: Batch job submission failed: "
                         "Requested node configuration is not available")

    monkeypatch.setattr(fake, "test_only", refuse)
    monkeypatch.setattr(commands, "make_client", lambda: fake)
    assert main(["submit", str(_spec(tmp_path)), "--dry-run"]) == 1
    err = capsys.readouterr().err
    assert err == ("relax-hpc submit: sbatch --test-only exited 1: sbatch: error: Batch job submission failed: "
                   "Requested node configuration is not available\n")
    assert not (tmp_path / "job").exists()


def test_the_subprocess_client_hands_the_script_to_sbatch_test_only_on_stdin(tmp_path: Path) -> None:
    # A stand-in sbatch that answers as Slurm's does (on stderr) and records its arguments and stdin;
    # the real one is asked in tests/slurm/test_dev_slurm_dry_run.py.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    sbatch = bin_dir / "sbatch"
    sbatch.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path / 'args'}\ncat > {tmp_path / 'stdin'}\n"
                      "grep -q refuse {stdin} && { echo 'sbatch: error: Batch job submission failed: Requested node "
                      "configuration is not available' >&2; exit 1; }\n"
                      "echo 'sbatch: Job 12 to start at 2026-12-02T10:00:00 using 2 processors on n[1-2]' >&2\n"
                      .replace("{stdin}", str(tmp_path / "stdin")))
    sbatch.chmod(0o755)
    client = SubprocessSlurmClient()
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}
    script = "#!/bin/bash\n#SBATCH --nodes=1\n#SBATCH hetjob\n#SBATCH --nodes=1\necho hi\n"
    answer = client.test_only(script, tmp_path, env)
    assert answer == "sbatch: Job 12 to start at 2026-12-02T10:00:00 using 2 processors on n[1-2]"
    assert (tmp_path / "args").read_text() == "--test-only\n" and (tmp_path / "stdin").read_text() == script
    with pytest.raises(SlurmError, match=r"^sbatch --test-only exited 1: sbatch: error: Batch job submission "
                                         r"failed: Requested node configuration is not available$"):
        client.test_only(script + "# refuse\n", tmp_path, env)
