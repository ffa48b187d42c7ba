"""The batch script's decision after the driver ends: requeue the job, or end it with the status.

The functions are taken from the rendered script and run with bash under a fake ``scontrol``
that records its arguments, so every branch is checked without Slurm:
tests/slurm/test_driver_requeue.py kills a real driver on the local Slurm.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
from pathlib import Path

import pytest

from relax_hpc.launch.render import render_sbatch
from relax_hpc.spec import JobSpec, load_spec

REPO = Path(__file__).resolve().parents[2]
FUNCTIONS = ("log", "requeue_if_signalled", "requeue_if_killed", "finish")


def _spec(max_global_restarts: int | None = None) -> JobSpec:
    spec = load_spec(REPO / "jobspecs" / "tiny_slurm.toml")
    if max_global_restarts is None:
        return spec
    return dataclasses.replace(spec, health=dataclasses.replace(spec.health, max_global_restarts=max_global_restarts))


def _decision_code(script: str) -> str:
    """The settings and functions of ``script`` that decide what happens after the driver ends."""
    parts = [re.search(r"(?m)^MAX_RESTARTS=.*$", script)]
    parts.append(re.search(r"(?m)^log\(\) \{.*\}$", script))
    for name in FUNCTIONS[1:]:
        parts.append(re.search(rf"(?ms)^{name}\(\) \{{\n.*?^\}}$", script))
    assert all(parts), f"the rendered script no longer defines {FUNCTIONS} and MAX_RESTARTS"
    return "\n".join(p.group(0) for p in parts if p)


def _finish(tmp_path: Path, script: str, status: int, *, signalled: str = "", restart: int = 0,
            requeue: int = 1, scontrol_status: int = 0) -> tuple[int, str, list[str]]:
    """Run ``finish STATUS`` of ``script``: (exit status, its log, the scontrol calls)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    calls = tmp_path / "scontrol.calls"
    calls.write_text("")
    fake = bin_dir / "scontrol"
    fake.write_text(f'#!/bin/bash\necho "$*" >> {calls}\nexit {scontrol_status}\n')
    fake.chmod(0o755)
    kills = tmp_path / "logs" / "driver-kills"  # one line per earlier requeue after a kill
    kills.parent.mkdir(exist_ok=True)
    kills.write_text("".join(f"attempt {n}: SIGKILL\n" for n in range(restart)))
    code = "\n".join([
        _decision_code(script),
        f'PATH={bin_dir}:"$PATH"',
        f"REQUEUE={requeue} SIGNALLED={signalled!r} RESTART={restart + 2} SLURM_JOB_ID=42 JOB_DIR={tmp_path}",
        f"finish {status}",
        "echo 'finish returned'",  # never reached: finish always ends the script
    ])
    done = subprocess.run(["bash", "-c", code], capture_output=True, text=True, timeout=30, check=False)
    return done.returncode, done.stdout + done.stderr, calls.read_text().splitlines()


def test_the_script_renders_the_restart_budget_and_decides_after_stopping_ray() -> None:
    assert "\nMAX_RESTARTS=3 " in render_sbatch(_spec(), "/j", "/j/s.toml")  # the [health] default
    text = render_sbatch(_spec(max_global_restarts=5), "/j", "/j/s.toml")
    assert "\nMAX_RESTARTS=5 " in text
    assert text.endswith('stop_sruns\nfinish "$status"\n')


@pytest.mark.parametrize(("status", "signal"), [(137, "KILL"), (139, "SEGV"), (134, "ABRT")])
def test_a_driver_killed_by_a_signal_requeues_the_job(tmp_path: Path, status: int, signal: str) -> None:
    code, log, calls = _finish(tmp_path, render_sbatch(_spec(), "/j", "/j/s.toml"), status)
    assert (code, calls) == (0, ["requeue 42"]), log
    assert f"the driver was killed by SIG{signal} (exit status {status}); requeueing job 42 (restart 1 of 3)" in log
    # Counted in the job directory: requeues after a stop signal (SLURM_RESTART_COUNT 2 here) are not.
    assert (tmp_path / "logs" / "driver-kills").read_text() == f"attempt 2: SIG{signal}\n"


def test_the_last_restart_is_the_budget_then_the_job_ends_with_the_drivers_status(tmp_path: Path) -> None:
    script = render_sbatch(_spec(max_global_restarts=5), "/j", "/j/s.toml")
    code, log, calls = _finish(tmp_path, script, 137, restart=4)
    assert (code, calls) == (0, ["requeue 42"]) and "(restart 5 of 5)" in log, log
    code, log, calls = _finish(tmp_path, script, 137, restart=5)
    assert (code, calls) == (137, []), log
    assert "no restarts left (5 of [health] max_global_restarts = 5 used)" in log
    code, log, calls = _finish(tmp_path, render_sbatch(_spec(max_global_restarts=0), "/j", "/j/s.toml"), 137)
    assert (code, calls) == (137, []) and "no restarts left" in log, log


@pytest.mark.parametrize("status", [1, 2, 120, 128, 255])
def test_a_driver_that_failed_by_itself_does_not_requeue(tmp_path: Path, status: int) -> None:
    """1..128: an error the driver reported in its log; 255 names no signal."""
    code, log, calls = _finish(tmp_path, render_sbatch(_spec(), "/j", "/j/s.toml"), status)
    assert (code, calls) == (status, []), log
    assert "requeue" not in log


def test_a_driver_killed_during_a_stop_or_with_requeue_off_does_not_requeue(tmp_path: Path) -> None:
    script = render_sbatch(_spec(), "/j", "/j/s.toml")
    code, log, calls = _finish(tmp_path, script, 137, signalled="TERM")  # the job is being stopped
    assert (code, calls) == (137, []), log
    code, log, calls = _finish(tmp_path, script, 137, requeue=0)
    assert (code, calls) == (137, []) and "not requeueing: [cluster] requeue = false" in log, log


def test_a_failed_scontrol_requeue_ends_the_job_with_the_drivers_status(tmp_path: Path) -> None:
    code, log, calls = _finish(tmp_path, render_sbatch(_spec(), "/j", "/j/s.toml"), 137, scontrol_status=1)
    assert (code, calls) == (137, ["requeue 42"]) and "scontrol requeue failed" in log, log


def test_a_clean_exit_requeues_only_after_a_stop_signal(tmp_path: Path) -> None:
    script = render_sbatch(_spec(), "/j", "/j/s.toml")
    assert _finish(tmp_path, script, 0)[::2] == (0, [])
    code, log, calls = _finish(tmp_path, script, 0, signalled="USR1")
    assert (code, calls) == (0, ["requeue 42"]) and "the next attempt resumes" in log, log


def test_a_stop_request_ends_the_job_after_the_checkpoint_without_a_requeue(tmp_path: Path) -> None:
    script = render_sbatch(_spec(), "/j", "/j/s.toml")
    assert "trap 'on_signal USR2' USR2" in script  # `relax-hpc cancel --stop`
    code, log, calls = _finish(tmp_path, script, 0, signalled="USR2")
    assert (code, calls) == (0, []) and "stopped on request; not requeueing" in log, log
    code, log, calls = _finish(tmp_path, script, 137, signalled="USR2")  # killed while stopping: not a kill to redo
    assert (code, calls) == (137, []), log
