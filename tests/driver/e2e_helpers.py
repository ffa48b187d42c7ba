"""Shared helpers for the end-to-end tests: a tiny model built once and spec text around it."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "jobspecs" / "data" / "tiny_sum.jsonl"


def tiny_spec_text(model_dir: Path, out_dir: Path, steps: int, save_interval: int = 50,
                   name: str = "e2e", extra: str = "") -> str:
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
lr = 5e-4
micro_batch_size = 256

[checkpoint]
save_interval = {save_interval}
keep_last = 2
{extra}
"""
