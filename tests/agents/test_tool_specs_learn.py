"""The two tool-calling example specs (jobspecs/agent_tools_langchain.toml, agent_tools_sdk.toml)
learn through `relax-hpc run` (Ray, the default agent mode), and their recorded samples train only
on what the model wrote.

Each test runs one shipped spec as a user would, with the job and the tiny tool model in pytest's
temporary directories and the trajectory archive on. Measured on 2 CPU cores (2026-12-04, 30 steps, mean
reward of the first 5 steps -> the last 10): sdk 0.015 -> 0.118 (seed 1), 0.014 -> 0.120
(seed 2); langchain 0.030 -> 0.166 (seed 1), 0.024 -> 0.178 (seed 2). The tests ask for 3x and
a rise of 0.05, a margin of 1.8x or more. 58-70 s each alone, 80-93 s beside the other
worker of the test command; the two runs share one written model.

    pytest -m slow tests/agents/test_tool_specs_learn.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from relax_hpc.models.tiny import IM_END, IM_START
from relax_hpc.ops.archive import TrajectoryRow, read_archive
from relax_hpc.ops.metrics import read_metrics
from relax_hpc.spec import load_spec

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the runs keep the tiny tool model: the first run writes it, the second reads it."""
    return tmp_path_factory.mktemp("tool-model") / "tiny-qwen3-tools"


def run_spec(name: str, tmp_path: Path, model: Path) -> Path:
    """`relax-hpc run jobspecs/NAME.toml` with its output under tmp_path and its model at `model`;
    the job dir."""
    job = tmp_path / name
    cmd = [sys.executable, "-m", "relax_hpc.cli.main", "run", f"jobspecs/{name}.toml", "--no-progress",
           "--set", f"job.output_dir={job}", "--set", f"model.path={model}",
           "--set", "metrics.trajectory_archive=true", "--set", "metrics.tensorboard=false",
           "--set", "metrics.plot=false"]
    env = os.environ | {"RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return job


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def model_written_mask(ids: list[int], tok: AutoTokenizer) -> list[int]:
    """1 on the tokens of the assistant's turns after their `assistant:` header, up to and with
    the turn's end (a reply cut at the token limit runs to the end of the sample); 0 elsewhere."""
    start, end = tok.convert_tokens_to_ids(IM_START), tok.convert_tokens_to_ids(IM_END)
    header = tok.encode("assistant:", add_special_tokens=False)
    mask, inside, k = [0] * len(ids), False, 0
    while k < len(ids):
        if not inside and ids[k] == start and ids[k + 1:k + 1 + len(header)] == header:
            inside, k = True, k + 1 + len(header)
            continue
        if inside:
            mask[k] = 1
            inside = ids[k] != end
        k += 1
    return mask


def check_loss_masks(job: Path, model: Path) -> None:
    tok = AutoTokenizer.from_pretrained(model)
    rows: list[TrajectoryRow] = [r for step in read_archive(job).values() for r in step]
    assert rows
    tool_turns = 0
    for r in rows:
        expected = model_written_mask(r.prompt_ids + r.response_ids, tok)[len(r.prompt_ids):]
        assert r.loss_mask == expected, (tok.decode(r.prompt_ids + r.response_ids), r.loss_mask)
        tool_turns += "<|im_start|>tool:" in tok.decode(r.response_ids)
    assert tool_turns > 0, f"no sample of {job} holds a tool result"


def check_learns(job: Path, name: str) -> None:
    rewards = [r["reward/mean"] for r in read_metrics(job / "metrics.jsonl")]
    assert len(rewards) == load_spec(REPO / "jobspecs" / f"{name}.toml").train.steps, rewards
    first, last = mean(rewards[:5]), mean(rewards[-10:])
    assert first > 0.0, rewards  # a random policy calls and ends its turn about once in 60 replies
    assert last >= 3 * first and last >= first + 0.05, rewards


@pytest.mark.slow
@pytest.mark.parametrize("name", ["agent_tools_sdk", "agent_tools_langchain"])
def test_the_tool_spec_learns_and_trains_only_on_the_model_tokens(name: str, tmp_path: Path, model_dir: Path) -> None:
    job = run_spec(name, tmp_path, model_dir)
    check_learns(job, name)
    check_loss_masks(job, model_dir)
