"""Commands that need no tensors answer at once: each runs in a fresh interpreter, and afterwards
neither torch nor Ray (nor transformers) is in its sys.modules.

What is covered: `--help`, `--version`, `validate`, `show`, `render`, `status` of a local run's
directory, `logs` of a submitted job's directory and `inspect` of a real HDF5 trajectory archive,
each run to completion (exit 0). `cancel` and `status` of a submitted job need Slurm: they run
to completion with the in-memory FakeSlurmClient in place of the real client (status then also
loads the REST API client, FastAPI and httpx, to ask for the engines), and once more with the
real client and no Slurm commands on PATH, where they fail with a one-line error (exit 1) at the
scancel / squeue call. What the real commands' answers would lead to past that call is what the
fake's answers lead to. PATH is empty, so a local Slurm, when installed, changes nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from relax_hpc.data.sample import Sample
from relax_hpc.ops.archive import HDF5TrajectoryArchive, archive_dir
from relax_hpc.ops.run_status import RunStatus

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "ray", "transformers")
PROBE = ("import sys\n"
         "from relax_hpc.cli.main import main\n"
         "if sys.argv[1] == '--fake-slurm':  # Slurm's answers from the in-memory client\n"
         "    from relax_hpc.cli import slurm_commands as commands\n"
         "    from relax_hpc.launch.slurm_client import FakeSlurmClient, JobComponent\n"
         "    fake = FakeSlurmClient(jobs={'4242': [JobComponent('4242', 0, 'RUNNING', 'n1')]})\n"
         "    commands.make_client = lambda: fake\n"
         "    del sys.argv[1]\n"
         "try:\n    code = main(sys.argv[1:])\n"
         "except SystemExit as e:\n    code = e.code or 0\n"
         f"print('LOADED', sorted(m for m in {HEAVY!r} if m in sys.modules), code)")


def loaded(*argv: str, cwd: Path = REPO) -> tuple[str, subprocess.CompletedProcess[str]]:
    """The probe's last line, "LOADED [heavy modules] exit-code", and the whole run."""
    # An empty PATH: no Slurm client command is found, even where a local Slurm is installed.
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PATH": str(REPO / "no-such-bin"), "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", PROBE, *argv], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)
    lines = done.stdout.splitlines()
    return (lines[-1] if lines else ""), done


@pytest.fixture(scope="module")
def local_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local run's directory as the driver leaves it mid-run: status.json after step 2, and the
    trajectory archive of those two steps (archive steps 0 and 1)."""
    job = tmp_path_factory.mktemp("run")
    status = RunStatus(job, "tiny", total_steps=4)
    status.set_state("running")
    status.on_step(2, {"reward/mean": 0.25, "time/step_s": 1.0}, 4)
    archive = HDF5TrajectoryArchive(archive_dir(job))
    for step in (0, 1):
        archive.append(step, [Sample(prompt_ids=[1, 2], response_ids=[3], rollout_log_probs=[-0.5],
                                     weight_version=step, group_id=0, prompt_index=i, reward=1.0)
                              for i in range(2)])
    archive.close()
    return job


@pytest.fixture(scope="module")
def submitted_job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A submitted job's directory: its Slurm id and a driver log of its first attempt."""
    job = tmp_path_factory.mktemp("job")
    (job / "slurm_job_id").write_text("4242\n")
    (job / "logs" / "restart-0").mkdir(parents=True)
    (job / "logs" / "restart-0" / "driver.log").write_text("".join(f"line {i}\n" for i in range(10)))
    return job


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["validate", "tiny_local"], ["show", "tiny_local"],
                                  ["render", "tiny_slurm"], ["status", "--help"], ["submit", "--help"]],
                         ids=lambda argv: "-".join(argv))
def test_spec_commands_load_neither_torch_nor_ray(argv: list[str]) -> None:
    line, done = loaded(*argv)
    assert line == "LOADED [] 0", done.stdout[-2000:] + done.stderr


def test_status_logs_and_inspect_of_a_job_directory_load_neither_torch_nor_ray(
        local_run: Path, submitted_job: Path) -> None:
    line, done = loaded("status", str(local_run))
    assert line == "LOADED [] 0", done.stderr
    assert "2/4  reward 0.250" in done.stdout
    line, done = loaded("logs", str(submitted_job), "-n", "2")
    assert line == "LOADED [] 0", done.stderr
    assert "line 8\nline 9\n" in done.stdout and "line 7" not in done.stdout
    line, done = loaded("inspect", str(local_run))  # h5py and numpy read the archive, not torch
    assert line == "LOADED [] 0", done.stderr
    assert "2 step(s) (1-2), 4 rows" in done.stdout


def test_cancel_and_slurm_status_with_slurms_answers_load_neither_torch_nor_ray(submitted_job: Path) -> None:
    line, done = loaded("--fake-slurm", "status", str(submitted_job))
    assert line == "LOADED [] 0", done.stderr
    assert "4242" in done.stdout and "RUNNING" in done.stdout and "REST API:" in done.stdout
    line, done = loaded("--fake-slurm", "cancel", str(submitted_job), "--requeue")
    assert line == "LOADED [] 0", done.stderr
    assert "asked job 4242 to checkpoint and requeue" in done.stdout


def test_cancel_and_slurm_status_load_neither_torch_nor_ray_up_to_the_slurm_call(submitted_job: Path) -> None:
    for argv in (["cancel", str(submitted_job)], ["status", str(submitted_job)]):
        line, done = loaded(*argv)
        assert line == "LOADED [] 1", done.stderr  # no Slurm client on PATH: exit 1, one line
        assert "not found on PATH" in done.stderr and "Traceback" not in done.stderr
