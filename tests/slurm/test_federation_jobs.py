"""A running job grown by a grow job on the local Slurm: engines join, the main job is requeued
with the grow job attached (its engines register again), the grow job is cancelled mid-step, and
the main job still trains every sample exactly once; a few steps later it is stopped with
`relax-hpc cancel --stop` (checkpoint, then end without a requeue).

Needs tools/dev-slurm (see conftest.py); run with RELAX_TEST_SLURM=1. About 2.5 minutes on 2 cores.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from devslurm import DevSlurm
from test_relax_jobs import (
    PROMPTS,
    RELAX_HPC,
    SAMPLES,
    logs_of,
    relax_hpc,
    submit,
    summary,
    tiny_model,  # noqa: F401  (the module's fixture)
    wait_for_step,
    write_spec,
)

from relax_hpc.auth import JobSecret
from relax_hpc.engines.elastic.rest_api import RestClient, RestUnavailable

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]


def _engines(job_dir: Path) -> list[dict[str, Any]]:
    """The main job's engines from its REST API; [] while it has none up (a requeue)."""
    info = json.loads((job_dir / "cluster.json").read_text()) if (job_dir / "cluster.json").is_file() else {}
    if not info.get("rest_url"):
        return []
    token = JobSecret.load(job_dir / ".secret").token("rest")
    try:
        status, body = RestClient(info["rest_url"], token, timeout_s=10).get("/rollout/engines")
    except RestUnavailable:
        return []
    return body["engines"] if status == 200 else []


def _wait(what: str, check: Any, timeout: float = 600.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (found := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(1.0)
    return found


def _serving(job_dir: Path, grow_id: str, min_samples: int = 1) -> list[dict[str, Any]]:
    mine = [e for e in _engines(job_dir) if e["job"] == grow_id and e["state"] == "active"]
    return mine if len(mine) == 2 and all(e["samples"] >= min_samples for e in mine) else []


def test_a_grow_job_joins_survives_a_main_requeue_and_is_cancelled_mid_step_without_loss(
        dev_slurm: DevSlurm, tmp_path: Path, tiny_model: Path) -> None:
    # `steps` is only a bound: the job is stopped (`relax-hpc cancel --stop`: checkpoint, end) a few
    # steps after the grow job's cancel, which came at step 143 of a CI run (2026-11-29).
    steps = 300
    spec = write_spec(tmp_path, "t_grow", tiny_model, steps=steps, save_interval=20)
    spec.write_text(spec.read_text() + "\n[metrics]\ntrajectory_archive = true\n")
    job_dir = tmp_path / "t_grow"
    job_id = submit(dev_slurm, spec)
    wait_for_step(job_dir, 2, timeout=240)

    out = relax_hpc(dev_slurm, "grow", job_id, "--engines", "2")
    found = re.search(r"submitted grow job (\d+)", out)
    assert found, out
    grow_id = found.group(1)
    first = _wait("the grow job's engines to serve", lambda: _serving(job_dir, grow_id))
    assert all(e["weight_version"] > 0 for e in first), first  # they run the job's trained weights
    status = relax_hpc(dev_slurm, "status", job_id)
    assert grow_id in status and "RUNNING" in status, status

    # The main job is requeued with the grow job attached: its new driver lists no grow engine,
    # and the grow job registers them again.
    at_requeue = wait_for_step(job_dir, 25)
    dev_slurm.slurm("scontrol", "requeue", job_id)
    _wait("the requeued job's first steps", lambda: (job_dir / "logs" / "restart-1" / "driver.log").is_file()
          and "REST API" in (job_dir / "logs" / "restart-1" / "driver.log").read_text(), timeout=300)
    again = _wait("the grow job's engines to serve the requeued job", lambda: _serving(job_dir, grow_id))
    assert {e["address"] for e in again} == {e["address"] for e in first}

    # Cancelled in the middle of a step: the engines are killed while they hold prompts.
    serving_step = json.loads((job_dir / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    dev_slurm.slurm("scancel", grow_id)
    assert dev_slurm.wait_job_done(grow_id, timeout=120) == ["CANCELLED"]

    # The step the engines died in, and a few more, trained by the job's own engine; then the
    # job is asked to checkpoint and end.
    wait_for_step(job_dir, serving_step + 4, timeout=240)
    assert "checkpoint and end" in relax_hpc(dev_slurm, "cancel", job_id, "--stop")
    states = dev_slurm.wait_job_done(job_id, timeout=480)
    assert states == ["COMPLETED", "COMPLETED"], logs_of(job_dir, 0) + logs_of(job_dir, 1)
    done = summary(job_dir)
    assert done["stopped_early"] is True and serving_step + 4 <= done["end_step"] < steps  # type: ignore[operator]
    assert 0 < done["start_step"] <= at_requeue  # type: ignore[operator]
    assert "stopped on request; not requeueing" in (job_dir / "logs" / "restart-1" / "batch.log").read_text()
    assert not (job_dir / "logs" / "restart-2").exists()
    end = int(done["end_step"])  # type: ignore[arg-type]
    engines = {e["id"]: e for e in done["rollout_engines"]}  # type: ignore[union-attr]
    grow_engines = [e for e in engines.values() if e["job"] == grow_id]
    assert len(grow_engines) == 2 and all(e["state"] in ("failed", "gone") for e in grow_engines), engines
    assert sum(e["samples"] for e in grow_engines) > 0

    check = subprocess.run([str(RELAX_HPC), "inspect", str(job_dir), "--check-exactly-once"],
                           capture_output=True, text=True, timeout=120, check=False)
    assert check.returncode == 0, check.stdout + check.stderr
    assert check.stdout.strip().splitlines()[-1] == f"exactly-once: {end * PROMPTS * SAMPLES} samples, 0 duplicated, 0 lost"
    assert done["samples_trained"] == end * PROMPTS * SAMPLES  # counted across the requeue
    grow_log = "\n".join(p.read_text(errors="replace") for p in (job_dir / "logs").glob(f"grow-{grow_id}-node-*.log"))
    assert grow_log.count("registering 2 engine(s)") == 2, grow_log[-3000:]  # at the start and after the requeue
