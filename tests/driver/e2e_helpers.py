"""Shared helpers for the end-to-end tests: a tiny model built once and spec text around it."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "jobspecs" / "data" / "tiny_sum.jsonl"

# The tiny task's learning tests (a reward that must rise) run LEARN_STEPS steps
# at LEARN_LR. At the jobspecs' lr of 5e-4 the rise took 150 steps. At 3e-3, on a 2-core machine
# (2026-11-28; docs/testing.md, "Learning tests"), the mean reward of the first 5 steps was
# 0.010-0.016 and of steps 51-60 0.21-0.27 (job seeds 1-3; steps 41-50: 0.14-0.22, seeds 1-5):
# the tests ask > 0.08 and > 3x the start, a margin of 2.6x or more.
LEARN_STEPS = 60
LEARN_LR = 3e-3


def tiny_spec_text(model_dir: Path, out_dir: Path, steps: int, save_interval: int = 50,
                   name: str = "e2e", extra: str = "", lr: float = 5e-4) -> str:
    return f"""
[job]
name = "{name}"
output_dir = "{out_dir}"
seed = 1

[model]
path = "{model_dir}"

[data]
path = "{DATA}"
max_prompt_tokens = 16

[rollout]
prompts_per_step = 16
n_samples_per_prompt = 16
max_new_tokens = 4

[algorithm]
name = "grpo"

[reward]
function = "tiny_sum"

[train]
steps = {steps}
lr = {lr}
micro_batch_size = 256

[checkpoint]
save_interval = {save_interval}
keep_last = 2
{extra}
"""


@contextmanager
def ray_roles(spec: Any, num_processes: int = 1, timeout_s: float = 600.0) -> Iterator[tuple[Any, Path]]:
    """`RayRoles` for `spec` on a fresh local Ray, as `relax-hpc run` builds them (CPU, no queue
    roles); yields (roles, job_dir) and shuts the roles and Ray down afterwards."""
    import ray

    from relax_hpc.driver.run import prepare_job_dir, role_configs, start_ray
    from relax_hpc.roles.handles import RayRoles
    from relax_hpc.transfer.queue import queue_capacity

    job_dir = prepare_job_dir(spec)
    rollout, actor = role_configs(spec, job_dir, "cpu")
    r = spec.rollout
    start_ray(None)
    try:
        capacity = queue_capacity(r.prompts_per_step, spec.algorithm.max_staleness, r.n_samples_per_prompt)
        roles = RayRoles(rollout, actor, num_processes, [], capacity, timeout_s=timeout_s)
        try:
            yield roles, job_dir
        finally:
            roles.shutdown()
    finally:
        ray.shutdown()
