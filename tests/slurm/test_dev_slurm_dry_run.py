"""`relax-hpc submit --dry-run` against the local dev Slurm: Slurm's own `sbatch --test-only` answer
for the whole heterogeneous job, or its refusal, with no job queued and no file written.

Needs tools/dev-slurm (see conftest.py); run with RELAX_TEST_SLURM=1. A few seconds: nothing runs.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from devslurm import DevSlurm

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parents[2]
RELAX_HPC = Path(sys.executable).parent / "relax-hpc"
# sbatch's answer: slurm_het_job_will_run asks for each component in turn and prints one line for
# the whole job, "Job N to start at T using P processors on n[1-2]" (a plain job's line says "on
# nodes n1 in partition debug").
WILL_RUN = re.compile(r"Job \d+ to start at \S+ using \d+ processors on (nodes )?\S+")


def _spec(tmp_path: Path, nodes: int = 1) -> Path:
    text = (REPO / "jobspecs/tiny_slurm.toml").read_text()
    text = text.replace('name = "tiny_slurm"', f'name = "dry"\noutput_dir = "{tmp_path / "job"}"')
    text = text.replace("[cluster.trainer]\nnodes = 1", f"[cluster.trainer]\nnodes = {nodes}")
    path = tmp_path / "dry.toml"
    path.write_text(text)
    return path


def _dry_run(cluster: DevSlurm, spec: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(RELAX_HPC), "submit", str(spec), "--dry-run", *flags], capture_output=True, text=True,
                          cwd=spec.parent, timeout=90, env={**cluster.env(), "RAY_AUTH_MODE": "disabled"}, check=False)


def _queued(cluster: DevSlurm) -> list[str]:
    return cluster.slurm("squeue", "--noheader", "--format=%i").split()


def test_a_dry_run_prints_slurms_answer_and_queues_nothing(dev_slurm: DevSlurm, tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    before = _queued(dev_slurm)
    done = _dry_run(dev_slurm, spec)
    assert done.returncode == 0, done.stderr
    assert WILL_RUN.search(done.stdout), done.stdout
    assert "dry run: nothing was submitted or written" in done.stdout
    assert _queued(dev_slurm) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dry.toml"]  # no job directory, no script


def test_a_job_the_cluster_cannot_hold_gets_slurms_refusal(dev_slurm: DevSlurm, tmp_path: Path) -> None:
    spec = _spec(tmp_path, nodes=dev_slurm.nodes + 1)  # --no-preflight: Slurm itself refuses it
    done = _dry_run(dev_slurm, spec, "--no-preflight")
    assert done.returncode == 1, done.stdout + done.stderr
    # Slurm's own reason, as sbatch printed it (slurm-wlm 23.x: "allocation failure: Requested node
    # configuration is not available").
    assert done.stderr.startswith("relax-hpc submit: sbatch --test-only exited 1: ")
    assert "Requested node configuration is not available" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "job").exists()
