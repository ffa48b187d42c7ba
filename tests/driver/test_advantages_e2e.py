"""The Advantages role end to end: the same run as without it."""

from __future__ import annotations

from pathlib import Path

import pytest

from e2e_helpers import tiny_spec_text


@pytest.mark.slow
def test_training_with_the_role_equals_training_without_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The role computes the advantages rollout would have: the run is the same computation."""
    from relax_hpc.driver.run import run_job
    from relax_hpc.ops.metrics import read_metrics
    from relax_hpc.spec import parse_spec

    plain = tiny_spec_text(tiny_model_dir, tmp_path / "plain", steps=8, save_interval=8)
    with_role = tiny_spec_text(tiny_model_dir, tmp_path / "role", steps=8, save_interval=8).replace(
        "micro_batch_size = 256", "micro_batch_size = 256\nadvantages_role = true")
    spec = parse_spec(with_role)
    assert spec.train.advantages_role
    a = run_job(parse_spec(plain), in_process=True, progress=False).result.rewards
    b = run_job(spec, in_process=True, progress=False).result.rewards
    assert len(b) == 8 and a == b
    # The gradient norm scales with the advantages (the rewards, through Adam, hardly do; the
    # on-policy GRPO loss of group-centred advantages is ~0 whatever their scale).
    train = [{k: v for k, v in row.items() if k.startswith("train/")}
             for row in read_metrics(tmp_path / "plain" / "metrics.jsonl")]
    train_role = [{k: v for k, v in row.items() if k.startswith("train/")}
                  for row in read_metrics(tmp_path / "role" / "metrics.jsonl")]
    assert train_role == train and all(r["train/grad_norm"] > 1e-3 for r in train)


# On Ray, in async mode, the role is an actor of its own: tests/driver/test_loop_overlap.py's Ray run
# (one Ray start for that test and this one's).
