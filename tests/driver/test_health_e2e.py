"""The health manager end to end: `relax-hpc run` on Ray, roles killed while it trains.

A rollout engine is SIGKILLed (replaced in place: an engine of several), then the Reference
role three times in a row: twice it is restarted in place, the third failure costs a global
restart from the newest checkpoint. The run still finishes every step, every planned sample is
trained exactly once, and summary.json / metrics.jsonl count each restart.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from e2e_helpers import tiny_spec_text

from relax_hpc.ops.exactly_once import check_exactly_once
from relax_hpc.ops.health import read_heartbeats

pytestmark = pytest.mark.slow

STEPS = 40
EXTRA = """
[health]
heartbeat_s = 0.5
stale_s = 4

[metrics]
trajectory_archive = true
"""


def _steps_done(job_dir: Path) -> int:
    path = job_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def _wait(what: str, ready, run: subprocess.Popen, timeout_s: float = 240.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert run.poll() is None, f"the run ended (status {run.returncode}) while waiting for {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _pid(job_dir: Path, role: str) -> int:
    return int(read_heartbeats(job_dir)[role]["pid"])


@pytest.mark.timeout(600)
def test_a_role_killed_three_times_costs_a_global_restart_and_nothing_is_lost(tiny_model_dir: Path,
                                                                              tmp_path: Path) -> None:
    job_dir = tmp_path / "job"
    text = tiny_spec_text(tiny_model_dir, job_dir, steps=STEPS, save_interval=4, extra=EXTRA)
    text = (text.replace('name = "grpo"', 'name = "grpo"\nkl_coef = 0.01')
                .replace("micro_batch_size = 256", "micro_batch_size = 64\nreference_role = true")
                .replace("prompts_per_step = 16\nn_samples_per_prompt = 16",
                         "prompts_per_step = 4\nn_samples_per_prompt = 8\nnum_engines = 2"))
    spec = tmp_path / "spec.toml"
    spec.write_text(text)
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    log = (tmp_path / "run.log").open("w")
    run = subprocess.Popen([sys.executable, "-m", "relax_hpc.cli.main", "run", str(spec), "--no-progress"],
                           stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        _wait("step 2", lambda: _steps_done(job_dir) >= 2, run)
        os.kill(_pid(job_dir, "engine_0"), signal.SIGKILL)
        killed: list[int] = []
        for kill_at in (6, 12, 18):
            _wait(f"step {kill_at}", lambda k=kill_at: _steps_done(job_dir) >= k, run)
            _wait("a reference that is not one killed before",
                  lambda: "reference" in read_heartbeats(job_dir) and _pid(job_dir, "reference") not in killed, run)
            killed.append(_pid(job_dir, "reference"))
            os.kill(killed[-1], signal.SIGKILL)
        assert run.wait(timeout=400) == 0, (tmp_path / "run.log").read_text()[-3000:]
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
        log.close()

    output = (tmp_path / "run.log").read_text()
    summary = json.loads((job_dir / "summary.json").read_text())
    assert summary["end_step"] == STEPS and summary["samples_trained"] == STEPS * 4 * 8
    events = [(e["role"], e["action"]) for e in summary["health"]["events"]]
    assert events == [("engine_0", "in_place"), ("reference", "in_place"), ("reference", "in_place"),
                      ("reference", "global")], output[-3000:]
    assert (summary["health"]["in_place"], summary["health"]["global"]) == (3, 1)
    assert "health: reference died: global restart from the newest checkpoint" in output
    assert "failure 3 of this role in a row" in output
    records = [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines()]
    assert (records[-1]["health/in_place_restarts"], records[-1]["health/global_restarts"]) == (3, 1)
    report = check_exactly_once(job_dir)
    assert (report.samples, report.duplicated, report.lost) == (STEPS * 4 * 8, 0, 0), report
