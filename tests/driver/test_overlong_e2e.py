"""DAPO's overlong shaping in a real run (in process) of the tiny task: the soft penalty joins each
reward before the advantages, truncated samples train no token, and the step's metrics say so.
Read back from the trajectory archive, which keeps the shaped reward beside the raw one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from e2e_helpers import tiny_spec_text

from relax_hpc.algos import group_advantages
from relax_hpc.driver.run import run_job
from relax_hpc.ops.archive import read_archive
from relax_hpc.ops.metrics import read_metrics
from relax_hpc.spec import parse_spec

MAX_NEW, BUFFER, PENALTY = 4, 2, 0.5
STEPS = 3


def test_overlong_shaping_penalises_filters_and_reports(tiny_model_dir: Path, tmp_path: Path) -> None:
    text = tiny_spec_text(tiny_model_dir, tmp_path / "job", steps=STEPS, save_interval=STEPS,
                          extra="[metrics]\ntrajectory_archive = true\n")
    text = text.replace('[algorithm]\nname = "grpo"', '[algorithm]\nname = "grpo"\noverlong_filter = true\n'
                        f"overlong_buffer_len = {BUFFER}\noverlong_penalty = {PENALTY}")
    run_job(parse_spec(text), in_process=True, progress=False)

    archive = read_archive(tmp_path / "job")
    metrics = read_metrics(tmp_path / "job" / "metrics.jsonl")
    assert sorted(archive) == list(range(STEPS)) and len(metrics) == STEPS
    lengths_seen = set()
    for step, rows in archive.items():
        rows = sorted(rows, key=lambda r: r.sample_id)
        for row in rows:
            length = len(row.response_ids)
            lengths_seen.add(length)
            # free up to max_new_tokens - buffer = 2 tokens, then -(L - 2) / 2 * 0.5
            assert row.reward - row.raw_reward == pytest.approx(min(0.0, -(length - 2) / BUFFER * PENALTY), abs=1e-6)
        # A response that is not cut ends with EOS before max_new_tokens; one that is cut trains nothing.
        filtered = [r for r in rows if not any(r.loss_mask)]
        assert all(len(r.response_ids) == MAX_NEW for r in filtered)
        assert all(all(r.loss_mask) for r in rows if len(r.response_ids) < MAX_NEW)
        assert metrics[step]["rollout/overlong_filtered_frac"] == pytest.approx(len(filtered) / len(rows))
        assert metrics[step]["rollout/overlong_penalty_mean"] == pytest.approx(
            sum(r.reward - r.raw_reward for r in rows) / len(rows), abs=1e-6)
        # The advantages come from the shaped rewards, each group of 16 as GRPO normalises it.
        groups: dict[int, list] = {}
        for row in rows:
            groups.setdefault(row.group_id, []).append(row)
        assert sorted(len(g) for g in groups.values()) == [16] * 16
        for group in groups.values():
            want = group_advantages(torch.tensor([r.reward for r in group]), 16)
            assert torch.allclose(torch.tensor([r.advantage for r in group]), want, atol=1e-5)
    assert lengths_seen & {3, 4} and min(lengths_seen) <= 2  # the run met all three cases of the penalty
