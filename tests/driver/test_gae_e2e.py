"""PPO with a critic (advantage = "gae") on the tiny task: it lifts the reward like GRPO, warms
the critic up without training the actor, and checkpoints and resumes the critic with the actor.
On Ray: the fault suite's "in_place" run (tests/launch/test_faults_in_place.py) warms its critic up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from e2e_helpers import LEARN_LR, LEARN_STEPS, tiny_spec_text
from relax_hpc.driver.run import run_job
from relax_hpc.spec import parse_spec

pytestmark = pytest.mark.slow

# One micro-batch per step for the critic too (256 rows): the tiny model is fastest that way on CPU.
CRITIC = "[critic]\nlr = 1e-3\nmicro_batch_size = 256\n"


def _gae_spec(model_dir: Path, job: Path, steps: int, save_interval: int, critic: str = CRITIC) -> str:
    text = tiny_spec_text(model_dir, job, steps=steps, save_interval=save_interval, lr=LEARN_LR, extra=critic)
    return text.replace('[algorithm]\nname = "grpo"', '[algorithm]\nname = "grpo"\nadvantage = "gae"')


def _metrics(job: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]


def test_gae_lifts_the_reward_like_grpo(tiny_model_dir: Path, tmp_path: Path) -> None:
    report = run_job(parse_spec(_gae_spec(tiny_model_dir, tmp_path / "gae", LEARN_STEPS, LEARN_STEPS)),
                     in_process=True, progress=False)
    rewards = report.result.rewards
    first, last = sum(rewards[:5]) / 5, sum(rewards[-10:]) / 10
    # The thresholds of the other estimators (test_algorithms_e2e.py): from ~0.011 to ~0.2 here.
    assert last > 3 * first and last > 0.08, (first, last)
    metrics = _metrics(tmp_path / "gae")
    assert {"critic/loss", "critic/explained_variance", "critic/value_error"} <= set(metrics[-1])
    # The critic learns to predict the returns: it explains more of them late than at the start.
    late = sum(m["critic/explained_variance"] for m in metrics[-10:]) / 10
    assert late > 0.2 and late > metrics[0]["critic/explained_variance"], late


def test_warmup_then_checkpoint_and_resume_the_critic_with_the_actor(tiny_model_dir: Path, tmp_path: Path) -> None:
    job = tmp_path / "resume"
    critic = CRITIC + "warmup_steps = 1\n"
    first = run_job(parse_spec(_gae_spec(tiny_model_dir, job, 4, 2, critic)), in_process=True, progress=False)
    assert first.result.end_step == 4
    assert sorted(p.name for p in (job / "checkpoints_critic").iterdir()) == ["step_2", "step_4"]
    metrics = _metrics(job)
    # Step 1 is the warm-up: only the critic trained; the weight version still moved on.
    assert metrics[0]["critic/warmup"] == 1.0 and "train/loss/policy" not in metrics[0]
    assert metrics[1]["critic/warmup"] == 0.0 and "train/loss/policy" in metrics[1]
    assert [m["weight_version"] for m in metrics] == [1.0, 2.0, 3.0, 4.0]
    # A fresh critic's head is zero, so its values are exactly 0; its first step trains it away from that.
    assert metrics[0]["critic/values_mean"] == 0.0 and metrics[1]["critic/values_mean"] != 0.0

    second = run_job(parse_spec(_gae_spec(tiny_model_dir, job, 6, 2, critic)), in_process=True, progress=False)
    assert second.result.start_step == 4 and second.result.end_step == 6
    resumed = _metrics(job)[4]
    # The resumed critic is the one saved at step 4, not a fresh one (whose values would all be 0).
    assert resumed["critic/values_mean"] != 0.0 and resumed["critic/warmup"] == 0.0
    assert (job / "checkpoints_critic" / "step_6" / "critic.json").is_file()
