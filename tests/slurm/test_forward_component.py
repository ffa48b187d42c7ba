"""The three-component job on the local dev Slurm: trainer, rollout and forward, one node each.

jobspecs/tiny_slurm_fwd.toml runs ActorFwd and Reference on a third hetjob component. One short
variant of it is submitted with `relax-hpc submit` (the module's `preempted_job`) and sent the
pre-emption signal; its two tests check that it checkpoints, requeues itself, resumes and trains
every sample exactly once, and that its last attempt completes as one Ray cluster of three nodes
with both forward roles on the forward component's node (their heartbeat files name the Slurm
node they beat from: the dev cluster's nodes share one host, so the host name cannot tell them
apart).

A kill by `scontrol requeue` (resumed from the last periodic checkpoint) is the two-component
module's (test_relax_jobs.py): its next attempt starts as this job's does, each component's Ray
node again, so a third attempt here proved nothing more and cost about 90 s (docs/testing.md).
(A second job that only ran to completion proved nothing the last attempt of this one does not.)

Needs tools/dev-slurm with 3 nodes (see conftest.py); run with RELAX_TEST_SLURM=1. About 2
minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

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
    wait_for_step,
    write_spec,
)

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(600)]

COMPONENTS = ["trainer", "rollout", "forward"]


def write_fwd_spec(tmp_path: Path, name: str, model: Path, steps: int, save_interval: int) -> Path:
    """A short tiny_slurm_fwd job whose trajectory archive lets `inspect` check every sample, and
    whose roles beat every second, so their heartbeats show the rows they did."""
    spec = write_spec(tmp_path, name, model, steps, save_interval, source="tiny_slurm_fwd")
    spec.write_text(spec.read_text() + "\n[metrics]\ntrajectory_archive = true\n\n[health]\nheartbeat_s = 1.0\n")
    return spec


@pytest.fixture(scope="module")
def three_nodes(dev_slurm: DevSlurm) -> DevSlurm:
    if dev_slurm.nodes < len(COMPONENTS):  # Slurm never puts two components of one job on one node
        pytest.skip(f"the dev Slurm has {dev_slurm.nodes} nodes; this job needs {len(COMPONENTS)}")
    return dev_slurm


def component_nodes(cluster: DevSlurm, job_dir: Path) -> dict[str, str]:
    """Component name -> the Slurm node it ran on, from `relax-hpc status` (squeue's view)."""
    status = relax_hpc(cluster, "status", str(job_dir))
    nodes = dict(re.findall(r"(?m)^  (trainer|rollout|forward)\s+\d+\s+\w+\s+(\S+)", status))
    assert sorted(nodes) == sorted(COMPONENTS), status
    assert len(set(nodes.values())) == len(COMPONENTS), status  # three distinct nodes
    return nodes


def heartbeats(job_dir: Path) -> dict[str, dict[str, object]]:
    """Role -> its last heartbeat; "node" is the Slurm node it beat from (SLURMD_NODENAME)."""
    return {path.stem: json.loads(path.read_text()) for path in (job_dir / "health").glob("*.json")}


def check_exactly_once(job_dir: Path, samples: int) -> None:
    done = subprocess.run([str(RELAX_HPC), "inspect", str(job_dir), "--check-exactly-once"],
                          capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().splitlines()[-1] == f"exactly-once: {samples} samples, 0 duplicated, 0 lost"


STEPS, INTERVAL = 30, 10


@dataclass(frozen=True)
class PreemptedJob:
    job_dir: Path
    states: list[str]
    at_signal: int  # the step seen when the pre-emption signal was sent (attempt 0)
    nodes: dict[str, str]  # component -> node in the last attempt (squeue's view)


@pytest.fixture(scope="module")
def preempted_job(three_nodes: DevSlurm, tmp_path_factory: pytest.TempPathFactory,
                  tiny_model_dir: Path) -> PreemptedJob:
    """One job, sent the pre-emption signal in attempt 0 past its first periodic checkpoint;
    attempt 1 runs to the end."""
    tmp_path = tmp_path_factory.mktemp("fwd")
    spec = write_fwd_spec(tmp_path, "f_preempt", tiny_model_dir, steps=STEPS, save_interval=INTERVAL)
    job_dir = tmp_path / "f_preempt"
    job_id = submit(three_nodes, spec)

    at_signal = wait_for_step(job_dir, INTERVAL + 3, timeout=240)
    three_nodes.slurm("scancel", "--signal=USR1", "--batch", job_id)  # checkpoint now, then requeue
    _wait_for_attempt(job_dir, 1)
    # An attempt starts only after the one before is gone, so a step past the signalled one seen
    # after its driver log exists is that attempt's: its nodes, read while squeue knows the job.
    wait_for_step(job_dir, at_signal + 1, timeout=240)
    nodes = component_nodes(three_nodes, job_dir)
    return PreemptedJob(job_dir, three_nodes.wait_job_done(job_id, timeout=420), at_signal, nodes)


def _wait_for_attempt(job_dir: Path, attempt: int) -> None:
    deadline = time.monotonic() + 240
    while not (job_dir / "logs" / f"restart-{attempt}" / "driver.log").is_file():
        assert time.monotonic() < deadline, logs_of(job_dir, attempt - 1)
        time.sleep(0.5)


def test_the_three_component_job_resumes_after_a_preemption_and_trains_every_sample_once(
        preempted_job: PreemptedJob) -> None:
    job_dir = preempted_job.job_dir
    logs = "".join(logs_of(job_dir, n) for n in range(2))
    assert preempted_job.states == ["COMPLETED"] * 3, logs  # its three components
    first = (job_dir / "logs" / "restart-0" / "driver.log").read_text()
    stopped = re.search(r"stopped early at step (\d+) \(from 0\)", first)
    assert stopped, first
    assert int(stopped[1]) >= preempted_job.at_signal  # the signal checkpointed the step it was on
    batch = (job_dir / "logs" / "restart-0" / "batch.log").read_text()
    assert "got SIGUSR1" in batch and "requeueing job" in batch, batch
    assert not (job_dir / "logs" / "restart-2").exists(), logs  # one stop, one requeue

    done = summary(job_dir)
    assert done["end_step"] == STEPS and done["stopped_early"] is False
    assert done["start_step"] == int(stopped[1])  # attempt 1 redid nothing
    assert done["samples_trained"] == STEPS * PROMPTS * SAMPLES  # counted across the resume
    assert f"finished step {STEPS} (from {stopped[1]})" in (job_dir / "logs" / "restart-1" / "driver.log").read_text()
    check_exactly_once(job_dir, STEPS * PROMPTS * SAMPLES)


def test_the_forward_roles_run_on_their_own_node_and_the_three_component_job_completes(
        preempted_job: PreemptedJob) -> None:
    """The last attempt: one Ray cluster of three nodes, each role on its component's node."""
    job_dir, nodes = preempted_job.job_dir, preempted_job.nodes
    assert preempted_job.states == ["COMPLETED"] * 3, logs_of(job_dir, 1)
    batch = (job_dir / "logs" / "restart-1" / "batch.log").read_text()
    assert "3 Ray nodes joined" in batch, batch  # trainer, rollout and forward formed one cluster
    ray_forward = (job_dir / "logs" / "restart-1" / "ray-forward-0.log").read_text()
    assert f"relax-hpc node: forward slot 2 on {nodes['forward']}" in ray_forward, ray_forward

    # Each role beat from its component's node: placed by the Ray resource of that component.
    beats = heartbeats(job_dir)
    where = {role: beat["node"] for role, beat in beats.items()}
    assert where["actor_fwd"] == where["reference"] == nodes["forward"], (where, nodes)
    assert where["trainer_rank_0"] == where["driver"] == nodes["trainer"], (where, nodes)
    assert where["rollout"] == nodes["rollout"], (where, nodes)
    for role in ("actor_fwd", "reference"):  # the processes on that node did the forwards
        assert re.fullmatch(r"step \d+, [1-9]\d* rows done", str(beats[role]["doing"])), beats[role]
    # They did their work: the trainer's KL term is computed from Reference's log-probs (it
    # keeps no copy of the initial model) and grows from 0; ActorFwd's old log-probs come from
    # the weights each step starts with, so the PPO ratio stays 1 (in every attempt).
    rows = [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["step"] == 1 and rows[0]["train/loss/kl"] == pytest.approx(0.0, abs=1e-6)
    assert rows[-1]["step"] == STEPS and rows[-1]["train/loss/kl"] > 0
    assert all(r["train/ratio_mean"] == pytest.approx(1.0, abs=1e-4) for r in rows)
