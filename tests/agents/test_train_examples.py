"""The built-in agentic jobspecs train the tiny model on CPU with a rising reward (short runs)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from relax_hpc.agents.config import agent_code_problems
from relax_hpc.spec import load_spec

ROOT = Path(__file__).resolve().parents[2]


def test_jobspecs_validate_and_name_importable_envs() -> None:
    for name in ("agent_calculator", "agent_guess"):
        rollout = load_spec(ROOT / "jobspecs" / f"{name}.toml").rollout
        assert rollout.env is not None and agent_code_problems(rollout) == []


def short_run(name: str, steps: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[float]:
    from relax_hpc.driver.run import run_job

    monkeypatch.chdir(ROOT)  # the jobspecs name data paths relative to the repository
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    spec = load_spec(ROOT / "jobspecs" / f"{name}.toml")
    spec = dataclasses.replace(
        spec,
        job=dataclasses.replace(spec.job, output_dir=str(tmp_path / name)),
        model=dataclasses.replace(spec.model, path=str(tmp_path / "tiny")),
        train=dataclasses.replace(spec.train, steps=steps),
        checkpoint=dataclasses.replace(spec.checkpoint, save_interval=10_000),
        metrics=dataclasses.replace(spec.metrics, tensorboard=False, plot=False),
    )
    run_job(spec, in_process=True, progress=False)
    lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["reward/mean"] for line in lines]


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


@pytest.mark.slow
def test_calculator_tool_use_reward_rises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Measured: first-10 mean ~0.01 (a random policy rarely starts with "c"), ~0.09 by step 100
    # as the call "c" is learnt; the answer copying follows by step ~200.
    rewards = short_run("agent_calculator", 100, tmp_path, monkeypatch)
    assert len(rewards) == 100
    assert mean(rewards[-10:]) > mean(rewards[:10]) + 0.04, rewards


@pytest.mark.slow
def test_guess_game_reward_rises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Measured: ~0.01 at the start, ~0.15 by step 60 (digit guesses formed, some found).
    rewards = short_run("agent_guess", 60, tmp_path, monkeypatch)
    assert len(rewards) == 60
    assert mean(rewards[-10:]) > mean(rewards[:10]) + 0.05, rewards
