"""relax-hpc jobs on the local dev Slurm: submit, status, requeue, pre-emption, clashes, failures.

Each test submits a short variant of jobspecs/tiny_slurm.toml (trainer and rollout, one node
each) with `relax-hpc submit` and watches it through Slurm and its job directory; two jobs
interrupted at once (`interrupted_jobs`) are read by two tests. Needs
tools/dev-slurm (see conftest.py); run with RELAX_TEST_SLURM=1. About 3 minutes on 2 cores.
"""

from __future__ import annotations

import json
import re
import socket
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from devslurm import DevSlurm

from relax_hpc.ops.ports import ray_ports

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(400)]

REPO = Path(__file__).resolve().parents[2]
RELAX_HPC = Path(sys.executable).parent / "relax-hpc"
PROMPTS, SAMPLES = 8, 32  # jobspecs/tiny_slurm.toml


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tiny model for every job here, so concurrent jobs never build it at the same time."""
    from relax_hpc.models.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny-qwen3", seed=1)


def write_spec(tmp_path: Path, name: str, model: Path, steps: int, save_interval: int,
               source: str = "tiny_slurm") -> Path:
    """jobspecs/<source>.toml, named ``name``, with its job dir under ``tmp_path`` and a short run."""
    text = (REPO / "jobspecs" / f"{source}.toml").read_text()
    text = text.replace(f'name = "{source}"', f'name = "{name}"\noutput_dir = "{tmp_path / name}"')
    text = text.replace('path = "runs/models/tiny-qwen3"', f'path = "{model}"')
    text = re.sub(r"(?m)^steps = \d+", f"steps = {steps}", text)
    text = re.sub(r"(?m)^save_interval = \d+", f"save_interval = {save_interval}", text)
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    return path


def relax_hpc(cluster: DevSlurm, *args: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run([str(RELAX_HPC), *args], capture_output=True, text=True, cwd=REPO, timeout=120,
                          env={**cluster.env(), "RAY_AUTH_MODE": "disabled", **(env or {})}, check=False)
    assert done.returncode == 0, f"relax-hpc {' '.join(args)} exited {done.returncode}:\n{done.stderr}"
    return done.stdout


def submit(cluster: DevSlurm, spec: Path, env: dict[str, str] | None = None) -> str:
    out = relax_hpc(cluster, "submit", str(spec), env=env)
    found = re.search(r"submitted job (\d+)", out)
    assert found, out
    return found.group(1)


def last_step(job_dir: Path) -> int:
    path = job_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return json.loads(lines[-1])["step"] if lines else 0


# The deadlines of these tests are safety nets for a hung job, not timings: a quiet 2-core machine
# reaches step 1 in about 20 s, a machine at a load average of 12 took over 150 s (2026-11-28).
def wait_for_step(job_dir: Path, step: int, timeout: float = 600.0) -> int:
    deadline = time.monotonic() + timeout
    while (now := last_step(job_dir)) < step:
        assert time.monotonic() < deadline, f"{job_dir} did not reach step {step} (at {now})"
        time.sleep(0.5)
    return now


def summary(job_dir: Path) -> dict[str, object]:
    return json.loads((job_dir / "summary.json").read_text())


def logs_of(job_dir: Path, restart: int) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted((job_dir / "logs" / f"restart-{restart}").glob("*.log")))


STEPS, INTERVAL = 40, 10


@dataclass(frozen=True)
class InterruptedJobs:
    """Two jobs run at once on the same nodes: one requeued with `scontrol requeue`, the other
    sent the pre-emption signal; both then run to the end."""

    tmp_path: Path
    requeued: tuple[str, Path]  # job id, job dir
    signalled: tuple[str, Path]
    at_requeue: int
    at_signal: int
    running_status: str  # `relax-hpc status JOB` of the signalled job while it trained
    states: dict[str, list[str]]


@pytest.fixture(scope="module")
def interrupted_jobs(dev_slurm: DevSlurm, tmp_path_factory: pytest.TempPathFactory,
                     tiny_model: Path) -> InterruptedJobs:
    tmp_path = tmp_path_factory.mktemp("interrupted")
    requeued = write_spec(tmp_path, "t_requeue", tiny_model, steps=STEPS, save_interval=INTERVAL)
    signalled = write_spec(tmp_path, "t_signal", tiny_model, steps=STEPS, save_interval=INTERVAL)
    requeued_id, signalled_id = submit(dev_slurm, requeued), submit(dev_slurm, signalled)
    requeued_dir, signalled_dir = tmp_path / "t_requeue", tmp_path / "t_signal"

    wait_for_step(signalled_dir, 1)
    running = relax_hpc(dev_slurm, "status", signalled_id)
    at_requeue = wait_for_step(requeued_dir, INTERVAL + 2)
    dev_slurm.slurm("scontrol", "requeue", requeued_id)
    at_signal = wait_for_step(signalled_dir, INTERVAL + 3)
    dev_slurm.slurm("scancel", "--signal=USR1", "--batch", signalled_id)
    states = {job_id: dev_slurm.wait_job_done(job_id, timeout=600) for job_id in (requeued_id, signalled_id)}
    return InterruptedJobs(tmp_path, (requeued_id, requeued_dir), (signalled_id, signalled_dir), at_requeue,
                           at_signal, running, states)


def test_requeue_and_preemption_resume_and_train_every_sample_once(interrupted_jobs: InterruptedJobs) -> None:
    jobs = interrupted_jobs
    for job_id, job_dir in (jobs.requeued, jobs.signalled):
        assert jobs.states[job_id] == ["COMPLETED", "COMPLETED"], logs_of(job_dir, 0) + logs_of(job_dir, 1)
        done = summary(job_dir)
        assert done["end_step"] == STEPS and done["stopped_early"] is False
        assert done["samples_trained"] == STEPS * PROMPTS * SAMPLES  # none twice, none lost
        assert (job_dir / "logs" / "restart-1" / "driver.log").is_file()
    requeued_dir, signalled_dir = jobs.requeued[1], jobs.signalled[1]
    # scontrol requeue kills the job: it resumes from the last periodic checkpoint.
    assert 0 < summary(requeued_dir)["start_step"] <= jobs.at_requeue  # type: ignore[operator]
    # The signal makes the driver checkpoint the step it is on: nothing is redone.
    assert summary(signalled_dir)["start_step"] >= jobs.at_signal  # type: ignore[operator]
    assert "got SIGUSR1" in (signalled_dir / "logs" / "restart-0" / "batch.log").read_text()
    assert "requeueing job" in (signalled_dir / "logs" / "restart-0" / "batch.log").read_text()


def test_submit_runs_one_hetjob_with_one_ray_cluster_and_completes(
        dev_slurm: DevSlurm, interrupted_jobs: InterruptedJobs) -> None:
    """What any relax-hpc job shows, read from the pre-empted one (a job that only ran to its end
    proved nothing more; docs/testing.md): both components running as one Ray cluster, then
    COMPLETED on two nodes, `status`, `logs`, cluster.json, and the DCP -> HF export as a Slurm job."""
    job_id, job_dir = interrupted_jobs.signalled
    running = interrupted_jobs.running_status
    assert re.search(r"trainer\s+\d+\s+RUNNING", running) and re.search(r"rollout\s+\d+\s+RUNNING", running), running
    assert interrupted_jobs.states[job_id] == ["COMPLETED", "COMPLETED"], logs_of(job_dir, 1)
    for attempt in (0, 1):  # trainer + rollout formed one cluster, each time
        assert "2 Ray nodes joined" in (job_dir / "logs" / f"restart-{attempt}" / "batch.log").read_text()
    status = relax_hpc(dev_slurm, "status", str(job_dir))
    nodes = dict(re.findall(r"(trainer|rollout)\s+\d+\s+COMPLETED\s+(\S+)", status))
    assert set(nodes) == {"trainer", "rollout"} and nodes["trainer"] != nodes["rollout"], status
    assert f"step {STEPS}" in status
    cluster = job_dir / "cluster.json"
    assert stat.S_IMODE(cluster.stat().st_mode) == 0o600
    info = json.loads(cluster.read_text())
    assert info["job_id"] == int(job_id) and info["secret_file"] == str(job_dir / ".secret") and "rest_url" in info
    assert "token" not in info and (job_dir / ".secret").read_text().strip() not in cluster.read_text()
    assert f"finished step {STEPS}" in relax_hpc(dev_slurm, "logs", job_id)

    # The DCP -> HF export as a one-node Slurm job through submitit.
    hf = interrupted_jobs.tmp_path / "hf"
    out = relax_hpc(dev_slurm, "convert", str(job_dir), str(hf), "--slurm")
    convert_id = re.search(r"submitted convert job (\d+)", out)
    assert convert_id, out
    assert dev_slurm.wait_job_done(convert_id.group(1), timeout=600) == ["COMPLETED"]
    assert (hf / "config.json").is_file() and (hf / "model.safetensors").is_file()


def next_job_id(cluster: DevSlurm, tmp_path: Path) -> int:
    """The id Slurm gives the next job: one more than a held job's, submitted and cancelled here.

    (sbatch ignores SBATCH_HOLD, and `relax-hpc submit` has no hold: a job cannot be held from
    its submission to its start. The tests here submit one at a time, so ids are consecutive.)
    """
    probe = tmp_path / "next-id.sh"
    probe.write_text("#!/bin/bash\ntrue\n")
    held = cluster.slurm("sbatch", "--hold", "--parsable", "--job-name=next-id", f"--chdir={tmp_path}",
                         str(probe)).strip().split(";")[0]
    cluster.slurm("scancel", held)
    return int(held) + 1


def test_job_whose_ray_worker_cannot_start_fails_with_the_reason_in_its_log(
        dev_slurm: DevSlurm, tmp_path: Path, tiny_model: Path) -> None:
    spec = write_spec(tmp_path, "t_fail", tiny_model, steps=5, save_interval=5)
    job_dir = tmp_path / "t_fail"
    # The rollout node's port is taken before the job exists, so the job can never be first to it.
    expected_id = next_job_id(dev_slurm, tmp_path)
    blocker = socket.socket()
    try:
        blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        blocker.bind(("127.0.0.1", ray_ports(expected_id, 1).node_manager))
        blocker.listen()
        job_id = submit(dev_slurm, spec)
        assert int(job_id) == expected_id, f"another job was submitted meanwhile: got {job_id}, not {expected_id}"
        states = dev_slurm.wait_job_done(job_id, timeout=600)
        assert "FAILED" in states, states
    finally:
        blocker.close()
    text = logs_of(job_dir, 0)
    assert "cannot start Ray" in text and "in use" in text, text
    assert "FAILED: the Ray cluster did not form" in text
    # It failed fast, on the dead srun, not after cluster.ray_join_timeout_s (a check of what
    # happened rather than of a time: under load a fast failure can take minutes too).
    assert "exited early" in text and "within the timeout" not in text, text


def test_a_wheel_install_submits_the_embedded_spec_from_any_directory(
        dev_slurm: DevSlurm, tmp_path: Path, wheel_venv: tuple[Path, dict[str, str]]) -> None:
    """`relax-hpc submit tiny_slurm` from a non-editable install, run away from the checkout."""
    bin_dir, env = wheel_venv
    env = {k: v for k, v in env.items() if k != "RELAX_HPC_SBATCH_DIR"}  # the template from the wheel
    # Without the caller's PYTHONPATH: a checkout on it would shadow the wheel's package.
    slurm_env = {k: v for k, v in dev_slurm.env().items() if k != "PYTHONPATH"}
    done = subprocess.run([str(bin_dir / "relax-hpc"), "submit", "tiny_slurm"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=300, env={**slurm_env, **env}, check=False)
    assert done.returncode == 0, done.stderr
    found = re.search(r"submitted job (\d+)", done.stdout)
    assert found, done.stdout
    job_id, job_dir = found.group(1), tmp_path / "runs" / "tiny_slurm"
    try:
        wait_for_step(job_dir, 2, timeout=240)  # it trains: the data came from the wheel
    finally:
        dev_slurm.slurm("scancel", job_id)
    dev_slurm.wait_job_done(job_id, timeout=120)
    spec_text = (job_dir / "spec.toml").read_text()
    assert str(bin_dir.parent) in spec_text, spec_text  # [data] path inside the wheel's install
