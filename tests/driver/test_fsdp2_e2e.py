"""`relax-hpc run` of the embedded tiny spec with `[train] strategy = "fsdp2"` over 2 trainer
processes (gloo, CPU) and `[rollout] num_engines = 2`: the reward rises as with the default
strategy and the single engine, both engines served, and the checkpoint that two sharded ranks
wrote loads into one process. That the same command resumes from such a checkpoint (the
restored shards gathered and pushed to the engines before training goes on) is
test_train_e2e.py's signal-and-resume test, whose two trainer processes are FSDP2 ranks: a
second run here cost a whole start-up for two steps and put this test over the per-test budget
(docs/testing.md)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from e2e_helpers import DATA, LEARN_LR, LEARN_STEPS, REPO

from relax_hpc.ckpt import CheckpointManager, read_resume_file
from relax_hpc.models.hf import load_causal_lm
from relax_hpc.ops.metrics import read_metrics

pytestmark = pytest.mark.slow

STEPS = LEARN_STEPS  # at the learning tests' lr (tests/driver/e2e_helpers.py)


def _fsdp2_spec(model_dir: Path, job_dir: Path, steps: int = STEPS) -> str:
    """jobspecs/tiny_local.toml with this test's model, data and job directory, fewer steps and
    the sharded trainer."""
    text = (REPO / "jobspecs" / "tiny_local.toml").read_text()
    replacements = {
        r'(?m)^name = "tiny_local"$': f'name = "tiny_fsdp2"\noutput_dir = "{job_dir}"',
        r'(?m)^path = "runs/models/tiny-qwen3"$': f'path = "{model_dir}"',
        r'(?m)^path = "jobspecs/data/tiny_sum.jsonl"$': f'path = "{DATA}"',
        r"(?m)^steps = \d+$": f'steps = {steps}\nstrategy = "fsdp2"\nnum_processes = 2',
        r"(?m)^lr = 5e-4$": f"lr = {LEARN_LR}",
        r"(?m)^save_interval = \d+$": f"save_interval = {STEPS}",
        r"(?m)^temperature = 1.0$": "temperature = 1.0\nnum_engines = 2",
    }
    for pattern, new in replacements.items():
        text, count = re.subn(pattern, new, text)
        assert count == 1, f"jobspecs/tiny_local.toml changed: {pattern} no longer matches once"
    return text


@pytest.mark.timeout(900)
def test_fsdp2_over_two_processes_with_two_engines_trains_the_tiny_spec(tiny_model_dir: Path, tmp_path: Path) -> None:
    job = tmp_path / "job"
    spec_path = tmp_path / "spec.toml"
    spec_path.write_text(_fsdp2_spec(tiny_model_dir, job))
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "relax_hpc.cli.main", "run", str(spec_path), "--no-progress"]
    done = subprocess.run(cmd, check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=850)
    assert done.returncode == 0, done.stderr[-4000:]
    assert f"finished step {STEPS} (from 0)" in done.stdout

    rewards = [r["reward/mean"] for r in read_metrics(job / "metrics.jsonl")]
    assert len(rewards) == STEPS
    first, last = sum(rewards[:5]) / 5, sum(rewards[-10:]) / 10
    # As the default strategy's end-to-end test: a random policy answers ~1-2% right.
    assert first < 0.05
    assert last > 3 * first and last > 0.08, (first, last)
    summary = json.loads((job / "summary.json").read_text())
    engines = summary["rollout_engines"]
    assert [e["id"] for e in engines] == ["engine-0", "engine-1"]
    _each_rank_holds_its_share(summary["memory"], world=2)
    _as_validate_predicts(summary["memory"], spec_path, tiny_model_dir)
    assert all(e["alive"] and e["samples"] > 0 for e in engines), engines
    assert sum(e["samples"] for e in engines) == STEPS * 8 * 32  # the embedded spec's 8 x 32 per step

    # Two sharded ranks wrote the checkpoint; one unsharded process reads it back whole.
    checkpoint = job / "checkpoints" / f"step_{STEPS}"
    assert read_resume_file(checkpoint).world_size == 2
    before, after = load_causal_lm(tiny_model_dir), load_causal_lm(tiny_model_dir)
    state = CheckpointManager(job / "checkpoints").load_latest(after, torch.optim.AdamW(after.parameters()))
    assert state is not None and state.step == STEPS
    unchanged = [n for (n, p), (_, q) in zip(before.named_parameters(), after.named_parameters())
                 if torch.equal(p, q)]
    assert unchanged == [], f"parameters not trained: {unchanged}"


def _each_rank_holds_its_share(records: list[dict], world: int) -> None:
    """From the roles' memory records: each sharded rank's parameters and AdamW state are at most
    1/W + 0.1 of the whole model's (parameters plus two float32 moments), nothing a trainer rank
    keeps on its device is a whole copy of the model (rank 0's gathered copy for the engines is in
    host memory by design), the rollout role of two engines keeps its buffers in host memory, and
    each engine actor holds one copy."""
    trainers = [r for r in records if r["role"] == "trainer"]
    assert sorted(r["rank"] for r in trainers) == list(range(world)), records
    for r in trainers:
        model, held = r["model_bytes"], r["on_device"]
        assert model > 0 and held["parameters"] > 0 and held["optimizer"] > 0, r
        assert held["parameters"] + held["optimizer"] <= (1 / world + 0.1) * 3 * model, r
        copies = {k: held[k] for k in ("parameters", "gradients", "reference", "teacher", "channel_buffers")}
        assert all(v < model for v in copies.values()), r  # AdamW's two moments of a half are one model's bytes
    assert trainers[0]["in_host_memory"]["gathered_weights"] >= trainers[0]["model_bytes"]
    (rollout,) = [r for r in records if r["role"] == "rollout"]  # its two engines are actors of their own
    assert rollout["on_device"] == {"engine_weights": 0, "channel_buffers": 0}, rollout
    assert rollout["in_host_memory"]["weight_buffers"] >= rollout_model(records), rollout
    engines = [r for r in records if r["role"] == "engine"]
    assert [r["rank"] for r in engines] == [0, 1]
    assert all(r["on_device"]["engine_weights"] >= r["model_bytes"] > 0 for r in engines), engines


def rollout_model(records: list[dict]) -> int:
    return max(r["model_bytes"] for r in records if r["role"] == "trainer")


def _as_validate_predicts(records: list[dict], spec_path: Path, model_dir: Path) -> None:
    """Each sharded rank holds what `validate` predicts per trainer GPU (within 10%)."""
    from relax_hpc.spec import load_spec
    from relax_hpc.spec.memory_estimate import memory_estimate

    predicted = memory_estimate(load_spec(spec_path), json.loads((model_dir / "config.json").read_text()))[0]
    assert predicted.name == "trainer"
    for r in (r for r in records if r["role"] == "trainer"):
        for kind in ("parameters", "gradients", "optimizer"):
            expected = getattr(predicted, kind)
            assert abs(r["on_device"][kind] - expected) <= 0.1 * expected, (r["rank"], kind, r["on_device"], predicted)
