"""A driver killed with SIGKILL on the local Slurm: the job requeues itself, the next attempt
resumes from the newest checkpoint and the job still trains every sample exactly once.

The batch script's decision itself (which statuses requeue, the restart budget) is checked
without Slurm in tests/launch/test_requeue_on_kill.py. Needs tools/dev-slurm (see conftest.py);
run with RELAX_TEST_SLURM=1. About 2 minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from devslurm import DevSlurm
from test_relax_jobs import (
    PROMPTS,
    RELAX_HPC,
    SAMPLES,
    logs_of,
    submit,
    summary,
    wait_for_step,
    write_spec,
)

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(600)]


def _driver_pid(job_dir: Path) -> int:
    """The pid `relax-hpc run` wrote into JOBDIR/.lock, checked to be that driver on this host."""
    holder = json.loads((job_dir / ".lock").read_text())
    assert holder["host"] == socket.gethostname(), holder  # the dev Slurm runs its nodes here
    pid = int(holder["pid"])
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    assert b"relax_hpc.cli.main" in cmdline and b"run" in cmdline, cmdline
    return pid


def _wait_for_checkpoint(job_dir: Path, step: int, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while not (job_dir / "checkpoints" / f"step_{step}").is_dir():
        assert time.monotonic() < deadline, f"{job_dir} wrote no checkpoint step_{step}"
        time.sleep(0.5)


def test_a_killed_driver_requeues_the_job_which_resumes_and_trains_every_sample_once(
        dev_slurm: DevSlurm, tmp_path: Path, tiny_model_dir: Path) -> None:
    steps, interval = 30, 10
    spec = write_spec(tmp_path, "t_kill", tiny_model_dir, steps=steps, save_interval=interval)
    spec.write_text(spec.read_text() + "\n[metrics]\ntrajectory_archive = true\n")
    job_dir = tmp_path / "t_kill"
    job_id = submit(dev_slurm, spec)

    _wait_for_checkpoint(job_dir, interval)
    at_kill = wait_for_step(job_dir, interval + 2, timeout=240)  # steps after the checkpoint are redone
    os.kill(_driver_pid(job_dir), signal.SIGKILL)

    states = dev_slurm.wait_job_done(job_id, timeout=420)
    assert states == ["COMPLETED", "COMPLETED"], logs_of(job_dir, 0) + logs_of(job_dir, 1)
    first = (job_dir / "logs" / "restart-0" / "batch.log").read_text()
    assert "driver exited with status 137" in first, first
    assert f"the driver was killed by SIGKILL (exit status 137); requeueing job {job_id} (restart 1 of 3)" in first
    assert not (job_dir / "logs" / "restart-2").exists()  # one kill, one requeue

    done = summary(job_dir)
    assert done["end_step"] == steps and done["stopped_early"] is False
    assert interval <= done["start_step"] <= at_kill  # type: ignore[operator]
    second = job_dir / "logs" / "restart-1" / "driver.log"
    assert second.is_file(), logs_of(job_dir, 0)
    assert f"finished step {steps} (from {done['start_step']})" in second.read_text(), logs_of(job_dir, 1)
    assert done["samples_trained"] == steps * PROMPTS * SAMPLES  # counted across the requeue
    check = subprocess.run([str(RELAX_HPC), "inspect", str(job_dir), "--check-exactly-once"],
                           capture_output=True, text=True, timeout=120, check=False,
                           env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    assert check.returncode == 0, check.stdout + check.stderr
    assert check.stdout.strip().splitlines()[-1] == (
        f"exactly-once: {steps * PROMPTS * SAMPLES} samples, 0 duplicated, 0 lost")
