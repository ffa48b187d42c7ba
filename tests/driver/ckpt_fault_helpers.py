"""Shared by the checkpoint fault tests: a small copy of the embedded tiny spec, and the checks
that a job directory ends with a complete newest checkpoint and every sample trained once."""

from __future__ import annotations

import re
from pathlib import Path

from e2e_helpers import DATA, REPO

from relax_hpc.ckpt import read_resume_file
from relax_hpc.ckpt.validate import check_dcp_files
from relax_hpc.ops.exactly_once import check_exactly_once

TINY_LOCAL = REPO / "relax_hpc" / "jobspecs" / "tiny_local.toml"
PROMPTS, SAMPLES = 4, 4  # per step, and per prompt: a step trains 16 samples


def tiny_local_copy(model_dir: Path, job_dir: Path, steps: int, save_interval: int = 1) -> str:
    """relax_hpc/jobspecs/tiny_local.toml with this test's model, data and job directory, a few
    small steps, a checkpoint every `save_interval` steps (keep_last 2) and the trajectory
    archive on (exactly-once reads it)."""
    text = TINY_LOCAL.read_text()
    replacements = {
        r'(?m)^name = "tiny_local"$': f'name = "ckpt_faults"\noutput_dir = "{job_dir}"',
        r'(?m)^path = "runs/models/tiny-qwen3"$': f'path = "{model_dir}"',
        r'(?m)^path = "jobspecs/data/tiny_sum.jsonl"$': f'path = "{DATA}"',
        r"(?m)^prompts_per_step = \d+": f"prompts_per_step = {PROMPTS}",
        r"(?m)^n_samples_per_prompt = \d+$": f"n_samples_per_prompt = {SAMPLES}",
        r"(?m)^steps = \d+$": f"steps = {steps}",
        r"(?m)^save_interval = \d+$": f"save_interval = {save_interval}",
        r"(?m)^trajectory_archive = true": "tensorboard = false\nplot = false\ntrajectory_archive = true",
    }
    for pattern, new in replacements.items():
        text, count = re.subn(pattern, new, text)
        assert count == 1, f"{TINY_LOCAL} changed: {pattern} no longer matches once"
    return text


def assert_latest_is_complete(checkpoints: Path, step: int) -> None:
    """`latest` names step_<step>, which is whole (resume.json, DCP files), and nothing unfinished
    is left beside it."""
    assert (checkpoints / "latest").read_text() == f"step_{step}\n"
    newest = checkpoints / f"step_{step}"
    assert read_resume_file(newest).state.step == step
    check_dcp_files(newest)
    assert not [p.name for p in checkpoints.iterdir() if p.name.startswith("tmp_")]


def assert_every_sample_trained_once(job_dir: Path, steps: int) -> None:
    report = check_exactly_once(job_dir)
    assert report.ok, report.format()
    assert report.summary_line() == (
        f"exactly-once: {steps * PROMPTS * SAMPLES} samples, 0 duplicated, 0 lost")
