"""pack_rows: queue rows pack into exactly the TrainBatch pack_samples builds from their samples."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from relax_hpc.backends.batch import TrainBatch, pack_rows, pack_samples
from relax_hpc.data.rows import row_to_sample, sample_to_row
from relax_hpc.data.sample import Sample

PAD = 0
FIELDS = ("input_ids", "attention_mask", "targets", "loss_mask", "rollout_log_probs", "advantages",
          "old_log_probs", "ref_log_probs")


def _row(s: Sample) -> dict[str, Any]:
    """The row the trainer receives for `s`, with the forward roles' fields where `s` has them."""
    row = sample_to_row(s)
    if s.old_log_probs is not None:
        row["log_probs"] = torch.tensor(s.old_log_probs, dtype=torch.float32)
    if s.ref_log_probs is not None:
        row["ref_log_probs"] = torch.tensor(s.ref_log_probs, dtype=torch.float32)
    return row


def _assert_same(got: TrainBatch, want: TrainBatch) -> None:
    for name in FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        if b is None:
            assert a is None, name
            continue
        assert a is not None, name
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(a, b), name


def _random_sample(rng: random.Random, index: int, with_old: bool, with_ref: bool) -> Sample:
    prompt = [rng.randrange(3, 100) for _ in range(rng.randint(1, 7))]
    response = [rng.randrange(3, 100) for _ in range(rng.randint(0, 6))]
    r = len(response)

    def log_probs() -> list[float]:
        return [-rng.random() * 5 for _ in range(r)]

    # Multi-turn rows have observation tokens (mask 0) inside the response; some rows have none.
    mask = [rng.choice((0, 1)) for _ in range(r)] if rng.random() < 0.5 else None
    return Sample(
        prompt, response, log_probs(), weight_version=rng.randint(0, 3), group_id=index // 4,
        prompt_index=index, reward=rng.random(), raw_reward=rng.random(),
        advantage=rng.uniform(-2, 2), loss_mask=mask,
        old_log_probs=log_probs() if with_old else None,
        ref_log_probs=log_probs() if with_ref else None,
    )


@pytest.mark.parametrize("seed", range(60))
def test_random_rows_pack_like_their_samples(seed: int) -> None:
    rng = random.Random(seed)
    with_old, with_ref = rng.random() < 0.5, rng.random() < 0.5
    samples = [_random_sample(rng, i, with_old, with_ref) for i in range(rng.randint(1, 12))]
    if with_old and len(samples) > 1 and rng.random() < 0.3:
        samples[-1].old_log_probs = None  # one row without the field: no old log-probs at all
    pad = rng.choice((0, 2, 7))
    rows = [_row(s) for s in samples]
    _assert_same(pack_rows(rows, pad), pack_samples(samples, pad))
    # ...and like the samples the trainer used to rebuild from the same rows.
    _assert_same(pack_rows(rows, pad), pack_samples([row_to_sample(r) for r in rows], pad))


def test_rows_viewing_one_shared_buffer_are_read_not_written() -> None:
    rng = random.Random(1)
    samples = [_random_sample(rng, i, True, True) for i in range(9)]
    rows = [_row(s) for s in samples]
    # The queue may deliver a whole column in one allocation: rebuild every tensor field as a view.
    for name in ("tokens", "rollout_log_probs", "loss_mask", "log_probs", "ref_log_probs"):
        column = torch.cat([r[name] for r in rows])
        start = 0
        for r in rows:
            n = r[name].shape[0]
            r[name] = column[start : start + n]
            start += n
    before = {name: torch.cat([r[name] for r in rows]).clone()
              for name in ("tokens", "rollout_log_probs", "loss_mask", "log_probs", "ref_log_probs")}
    batch = pack_rows(rows, PAD)
    _assert_same(batch, pack_samples(samples, PAD))
    batch.input_ids.add_(1)
    batch.loss_mask.add_(1)
    batch.old_log_probs.add_(1)  # type: ignore[union-attr]
    for name, values in before.items():
        assert torch.equal(torch.cat([r[name] for r in rows]), values), name


def test_hand_worked_rows() -> None:
    a = {"tokens": torch.tensor([5, 6, 7, 8, 9]), "prompt_length": 3,
         "rollout_log_probs": torch.tensor([-0.1, -0.2]), "loss_mask": torch.tensor([1, 1], dtype=torch.int8),
         "advantages": 1.5, "log_probs": torch.tensor([-0.3, -0.4])}
    b = {"tokens": torch.tensor([5, 8, 9, 10]), "prompt_length": 1,
         "rollout_log_probs": torch.tensor([-1.0, -2.0, -3.0]),
         "loss_mask": torch.tensor([1, 0, 1], dtype=torch.int8),  # an observation token mid-response
         "advantages": -0.5, "log_probs": torch.tensor([-4.0, -5.0, -6.0])}
    c = {"tokens": torch.tensor([5, 6]), "prompt_length": 2,  # an empty response
         "rollout_log_probs": torch.zeros(0), "loss_mask": torch.zeros(0, dtype=torch.int8),
         "advantages": 0.25, "log_probs": torch.zeros(0)}
    batch = pack_rows([a, b, c], pad_id=3)
    # Lengths 5, 4, 2 -> L = 5, L-1 = 4 per-token columns. a: P=3, R=2 -> columns 2..3;
    # b: P=1, R=3 -> columns 0..2; c: R=0 -> none.
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9], [5, 8, 9, 10, 3], [5, 6, 3, 3, 3]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0], [1, 1, 0, 0, 0]]
    assert batch.targets.tolist() == [[6, 7, 8, 9], [8, 9, 10, 3], [6, 3, 3, 3]]
    assert batch.loss_mask.tolist() == [[0, 0, 1, 1], [1, 0, 1, 0], [0, 0, 0, 0]]
    torch.testing.assert_close(batch.rollout_log_probs, torch.tensor(
        [[0, 0, -0.1, -0.2], [-1.0, -2.0, -3.0, 0], [0, 0, 0, 0]]), rtol=0, atol=0)
    torch.testing.assert_close(batch.old_log_probs, torch.tensor(
        [[0, 0, -0.3, -0.4], [-4.0, -5.0, -6.0, 0], [0, 0, 0, 0]]), rtol=0, atol=0)
    assert batch.ref_log_probs is None  # no row has the field
    assert batch.advantages.tolist() == [1.5, -0.5, 0.25]
    assert batch.input_ids.dtype == batch.attention_mask.dtype == batch.targets.dtype == torch.long
    assert batch.loss_mask.dtype == batch.rollout_log_probs.dtype == torch.float32


def test_single_token_rows_have_no_per_token_columns() -> None:
    row = {"tokens": torch.tensor([4]), "prompt_length": 1, "rollout_log_probs": torch.zeros(0),
           "loss_mask": torch.zeros(0, dtype=torch.int8), "advantages": 0.0}
    batch = pack_rows([row], PAD)
    assert batch.input_ids.tolist() == [[4]] and batch.loss_mask.shape == (1, 0)
    _assert_same(batch, pack_samples([Sample([4], [], [], 0, 0, 0)], PAD))


def test_bad_rows_are_refused_with_the_row_and_field() -> None:
    good = sample_to_row(Sample([5, 6], [7, 8], [-0.1, -0.2], 0, 0, 0))
    with pytest.raises(ValueError, match="empty list of rows"):
        pack_rows([], PAD)
    with pytest.raises(ValueError, match="row 1 .* 3 values in field 'rollout_log_probs' but 2"):
        pack_rows([good, {**good, "rollout_log_probs": torch.zeros(3)}], PAD)
    # Equal totals would still misalign silently: the per-row count is what is checked.
    with pytest.raises(ValueError, match="row 0 .* field 'loss_mask'"):
        pack_rows([{**good, "loss_mask": torch.ones(1, dtype=torch.int8)},
                   {**good, "loss_mask": torch.ones(3, dtype=torch.int8)}], PAD)
    for bad in (0, 5):
        with pytest.raises(ValueError, match=f"row 0 .* prompt_length {bad} but 4 tokens"):
            pack_rows([{**good, "prompt_length": bad}], PAD)
