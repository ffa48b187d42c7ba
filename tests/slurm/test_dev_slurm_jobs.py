"""Jobs on the local dev cluster: plain batch + srun, a two-component hetjob, a requeue.

Needs tools/dev-slurm (see conftest.py); run with RELAX_TEST_SLURM=1.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from devslurm import DevSlurm

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(120)]


def need_two_nodes(cluster: DevSlurm) -> None:
    if cluster.nodes < 2:
        raise AssertionError(
            f"the dev cluster in {cluster.state_dir} has {cluster.nodes} node(s); these tests "
            "need >= 2: tools/dev-slurm down && tools/dev-slurm up --nodes 3"
        )


def test_plain_batch_job_runs_srun_on_two_nodes(dev_slurm: DevSlurm, tmp_path: Path) -> None:
    need_two_nodes(dev_slurm)
    out = tmp_path / "plain.out"
    # srun from inside the batch script must reach the other node's slurmd.
    job_id = dev_slurm.slurm(
        "sbatch", "--parsable", "--wait", "-N", "2", "-o", str(out),
        "--wrap", 'echo "batch on $SLURMD_NODENAME"; srun -N 2 bash -c \'echo "step on $SLURMD_NODENAME"\'',
    ).strip()

    assert dev_slurm.job_states(job_id) == ["COMPLETED"]
    lines = out.read_text().splitlines()
    steps = sorted(line.removeprefix("step on ") for line in lines if line.startswith("step on "))
    assert len(steps) == 2 and steps[0] != steps[1], lines
    assert lines[0].startswith("batch on n"), lines


HETJOB_SCRIPT = """#!/bin/bash
#SBATCH -N 1 -n 1
#SBATCH hetjob
#SBATCH -N 1 -n 1
echo "start $(date +%s.%N)"
echo "group0 $SLURM_JOB_NODELIST_HET_GROUP_0"
echo "group1 $SLURM_JOB_NODELIST_HET_GROUP_1"
echo "size $SLURM_HET_SIZE"
srun --het-group=0 bash -c 'echo "ran0 $SLURMD_NODENAME"' : --het-group=1 bash -c 'echo "ran1 $SLURMD_NODENAME"'
"""


def test_hetjob_components_run_on_different_nodes(dev_slurm: DevSlurm, tmp_path: Path) -> None:
    need_two_nodes(dev_slurm)
    script, out = tmp_path / "het.sh", tmp_path / "het.out"
    script.write_text(HETJOB_SCRIPT)
    submitted = time.time()
    job_id = dev_slurm.slurm("sbatch", "--parsable", "-o", str(out), str(script)).strip()

    states = dev_slurm.wait_job_done(job_id)
    assert states == ["COMPLETED", "COMPLETED"]
    pairs = (line.split(" ", 1) for line in out.read_text().splitlines())
    fields = {key: value for key, value in pairs}
    assert fields["size"] == "2"
    assert fields["group0"] and fields["group1"] and fields["group0"] != fields["group1"], fields
    # Each component's srun ran on the node its group was given.
    assert fields["ran0"] == fields["group0"] and fields["ran1"] == fields["group1"], fields
    # bf_interval=1 starts hetjobs in ~1 s; the default backfill interval takes ~30 s.
    start_delay = float(fields["start"]) - submitted
    assert start_delay < 10.0, f"hetjob started {start_delay:.1f}s after sbatch"


REQUEUE_SCRIPT = """#!/bin/bash
echo "run ${{SLURM_RESTART_COUNT:-0}}" >> {marks}
if [ "${{SLURM_RESTART_COUNT:-0}}" = 0 ]; then sleep 300; fi
"""


def wait_for_lines(path: Path, count: int, timeout: float) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = path.read_text().splitlines() if path.exists() else []
        if len(lines) >= count:
            return lines
        time.sleep(0.2)
    raise AssertionError(f"{path} has fewer than {count} lines after {timeout}s")


def test_requeue_reruns_script_with_restart_count(dev_slurm: DevSlurm, tmp_path: Path) -> None:
    marks, script = tmp_path / "marks.txt", tmp_path / "requeue.sh"
    script.write_text(REQUEUE_SCRIPT.format(marks=marks))
    job_id = dev_slurm.slurm(
        "sbatch", "--parsable", "--requeue", "-o", "/dev/null", str(script)
    ).strip()
    try:
        assert wait_for_lines(marks, 1, timeout=30) == ["run 0"]
        dev_slurm.slurm("scontrol", "requeue", job_id)
        # cred_expire=10 lets the requeued job start again after ~11 s (default: 120 s).
        assert wait_for_lines(marks, 2, timeout=45) == ["run 0", "run 1"]
        assert dev_slurm.wait_job_done(job_id) == ["COMPLETED"]
    finally:
        dev_slurm.slurm("scancel", job_id)
