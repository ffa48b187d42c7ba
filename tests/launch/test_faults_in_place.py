"""`relax-hpc faults` group "in_place" (tests/launch/fault_suite.py). A killed Reference, then a
stopped (hung) one, each restarted in place, then a killed critic rank (PPO, advantage = "gae", a
critic of 2 fsdp2 ranks): a global restart from the newest checkpoint, the critic's sharded one
included. All in one run on Ray, whose critic warms up for its first step (the fault run's
`[critic] warmup_steps = 1`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fault_suite import SuiteResult, group_tests

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # the first test pays for the group's run

(suite, test_fault_is_recovered_with_every_sample_trained_once,
 test_group_prints_the_table_and_the_last_line_and_exits_0,
 test_group_leaves_no_process_and_no_mount_behind) = group_tests("in_place")


def test_on_ray_the_critic_warms_up_and_the_steps_after_it_train(suite: SuiteResult) -> None:
    """The critic is two Ray actors (ranks of their own gloo group); after the warm-up step (the trainer's unchanged weights
    broadcast as its version) the trainer's queued steps follow that broadcast and train."""
    job_dir = Path(suite.rows["kill-critic"]["job_dir"])
    metrics = [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines()]
    first, second = metrics[0], metrics[1]
    assert (first["step"], first["critic/warmup"], first["weight_version"]) == (1, 1.0, 1.0)
    assert "train/loss/policy" not in first and first["critic/values_mean"] == 0.0  # a fresh head is zero
    assert (second["step"], second["critic/warmup"], second["weight_version"]) == (2, 0.0, 2.0)
    # Every later step trains the actor; resumed after the critic's kill from a checkpoint past the
    # warm-up, the run never warms up again.
    assert all("train/loss/policy" in m and m["critic/warmup"] == 0.0 for m in metrics[1:])
    # A zero head trained on zero returns stays zero; once it has seen a reward, its values move.
    seen = next(i for i, m in enumerate(metrics) if m["critic/returns_mean"] != 0.0)
    assert any(m["critic/values_mean"] != 0.0 for m in metrics[seen + 1:])
    last = suite.rows["kill-critic"]["run_steps"]
    meta = json.loads((job_dir / "checkpoints_critic" / f"step_{last}" / "critic.json").read_text())
    assert meta == {"step": last, "strategy": "fsdp2", "num_processes": 2}
