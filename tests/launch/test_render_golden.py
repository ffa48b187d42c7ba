"""Rendering a spec to sbatch text: golden files, and the parts each spec key controls.

Re-record the golden files after an intended change of the template or the renderer:

    RELAX_RECORD_GOLDEN=1 .venv/bin/pytest tests/launch/test_render_golden.py -q
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
from pathlib import Path

import pytest

from relax_hpc.launch.render import components, render_sbatch, sbatch_headers
from relax_hpc.spec import JobSpec, load_spec

REPO = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).parent / "golden"
SPECS = {
    "tiny_slurm": REPO / "jobspecs" / "tiny_slurm.toml",
    "tiny_slurm_fwd": REPO / "jobspecs" / "tiny_slurm_fwd.toml",
    "gpu_1node": Path(__file__).parent / "specs" / "gpu_1node.toml",
    "colocate_1node": Path(__file__).parent / "specs" / "colocate_1node.toml",
    "critic_fwd": Path(__file__).parent / "specs" / "critic_fwd.toml",
    "qwen3_omni": REPO / "jobspecs" / "qwen3_omni.toml",
}


def rendered(name: str) -> str:
    spec = load_spec(SPECS[name])
    job_dir = f"/shared/runs/{spec.job.name}"
    return render_sbatch(spec, job_dir, f"{job_dir}/spec.submit.toml")


@pytest.mark.parametrize("name", sorted(SPECS))
def test_render_matches_golden(name: str) -> None:
    golden = GOLDEN / f"{name}.sbatch"
    text = rendered(name)
    if os.environ.get("RELAX_RECORD_GOLDEN") == "1":
        golden.write_text(text)
    assert golden.is_file(), f"{golden} missing: record it with RELAX_RECORD_GOLDEN=1"
    assert text == golden.read_text(), (
        f"{name} renders differently from {golden}; if the change is intended, re-record with "
        "RELAX_RECORD_GOLDEN=1 and review the diff"
    )


@pytest.mark.parametrize("name", sorted(SPECS))
def test_rendered_script_is_valid_bash(name: str) -> None:
    done = subprocess.run(["bash", "-n"], input=rendered(name), capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


def test_render_is_pure_and_deterministic(tmp_path: Path) -> None:
    spec = load_spec(SPECS["tiny_slurm"])
    before = sorted(tmp_path.iterdir())
    assert render_sbatch(spec, "/j", "/j/s.toml") == render_sbatch(spec, "/j", "/j/s.toml")
    assert sorted(tmp_path.iterdir()) == before


def _groups(text: str) -> list[list[str]]:
    """The #SBATCH lines of each hetjob group (job-wide lines count as group 0's)."""
    groups: list[list[str]] = [[]]
    for line in text.splitlines():
        if line == "#SBATCH hetjob":
            groups.append([])
        elif line.startswith("#SBATCH "):
            groups[-1].append(line.removeprefix("#SBATCH "))
    return groups


def test_hetjob_groups_carry_their_component_options() -> None:
    groups = _groups(rendered("gpu_1node"))
    assert len(groups) == 3  # trainer, rollout, forward
    trainer, rollout, forward = groups
    for option in ["--nodes=1", "--gpus-per-node=4", "--cpus-per-task=16", "--mem=128G", "--partition=gpu",
                   "--account=rl-team", "--qos=normal", "--constraint=h100", "--time=04:00:00",
                   "--no-requeue", "--signal=B:USR1@120"]:
        assert option in trainer, option
    assert "--gpus-per-node=1" in rollout and "--cpus-per-task=8" in rollout
    assert not any(o.startswith(("--mem", "--account", "--qos")) for o in rollout)
    assert "--cpus-per-task=4" in forward


def test_cpu_only_spec_has_no_gpu_option_and_requeues() -> None:
    text = rendered("tiny_slurm")
    assert "--gpus-per-node" not in "\n".join(line for line in text.splitlines() if line.startswith("#SBATCH"))
    trainer, rollout = _groups(text)
    assert "--requeue" in trainer and "--signal=B:USR1@60" in trainer
    assert "--nodes=1" in rollout


def test_qwen3_omni_asks_for_16_gpus_on_2_nodes() -> None:
    spec = load_spec(SPECS["qwen3_omni"])
    gpus = sum(c.spec.nodes * c.spec.gpus_per_node for c in components(spec))
    nodes = sum(c.spec.nodes for c in components(spec))
    assert (gpus, nodes) == (16, 2)
    text = rendered("qwen3_omni")
    assert "container --nv --bind" in text and "--bind /models" in text and "exec --cleanenv" in text
    # [container] env goes through the owner-only env file, never onto the command line.
    assert '--env-file "$JOB_DIR/container.env"' in text and "NCCL_DEBUG" not in text


def test_extra_sbatch_lines_and_slots_of_multi_node_components() -> None:
    base = load_spec(SPECS["tiny_slurm"])
    trainer = dataclasses.replace(base.cluster.trainer, nodes=3, extra_sbatch=["--exclusive", "--reservation=r1"])
    rollout = dataclasses.replace(base.cluster.rollout, nodes=2)
    spec: JobSpec = dataclasses.replace(base, cluster=dataclasses.replace(base.cluster, trainer=trainer,
                                                                          rollout=rollout))
    assert "#SBATCH --exclusive" in sbatch_headers(spec, "/j") and "#SBATCH --reservation=r1" in sbatch_headers(spec, "/j")
    assert [(c.name, c.first_slot) for c in components(spec)] == [("trainer", 0), ("rollout", 3)]
    text = render_sbatch(spec, "/j", "/j/s.toml")
    assert "TOTAL_NODES=5" in text
    assert 'start_ray ray-trainer 0 trainer 2 1 1 0 1 --exclude="$HEAD_NODE" "--address=$HEAD"' in text
    assert 'start_ray ray-rollout 1 rollout 2 3 1 0 1 - "--address=$HEAD"' in text


def test_colocated_rollout_has_no_group_and_runs_on_the_trainer_nodes() -> None:
    spec = load_spec(SPECS["colocate_1node"])
    assert [(c.group, c.name, c.first_slot, c.also_hosts) for c in components(spec)] == [
        (0, "trainer", 0, ("rollout",)), (1, "forward", 1, ())]
    text = rendered("colocate_1node")
    trainer, forward = _groups(text)
    assert "--gpus-per-node=4" in trainer and "--cpus-per-task=4" in forward
    assert "TOTAL_NODES=2" in text and "WRAP_rollout" not in text and "ray-rollout" not in text
    assert 'start_ray ray-head 0 trainer 1 0 16 4 4 --nodelist="$HEAD_NODE" "--head --also-resource=rollout"' in text
    assert 'start_ray ray-forward 1 forward 1 1 4 1 1 - "--address=$HEAD"' in text


def test_colocated_multi_node_trainer_workers_advertise_rollout_too() -> None:
    base = load_spec(SPECS["colocate_1node"])
    trainer = dataclasses.replace(base.cluster.trainer, nodes=2)
    spec = dataclasses.replace(base, cluster=dataclasses.replace(base.cluster, trainer=trainer, forward=None))
    text = render_sbatch(spec, "/j", "/j/s.toml")
    assert _groups(text)[1:] == []  # one group: the trainer
    assert ('start_ray ray-trainer 0 trainer 1 1 16 4 4 --exclude="$HEAD_NODE" '
            '"--address=$HEAD --also-resource=rollout"') in text
