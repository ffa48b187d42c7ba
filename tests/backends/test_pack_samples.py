"""pack_samples: right padding and the shift that puts response tokens at columns P-1 .. P+R-2."""

from __future__ import annotations

import pytest
import torch

from relax_hpc.backends.batch import pack_samples
from relax_hpc.data.sample import Sample

PAD = 0


def _samples() -> list[Sample]:
    a = Sample([5, 6, 7], [8, 9], [-0.1, -0.2], 0, group_id=0, prompt_index=0, advantage=1.5)
    b = Sample([5], [8, 9, 10], [-1.0, -2.0, -3.0], 0, group_id=1, prompt_index=1, advantage=-0.5)
    return [a, b]


def test_alignment_hand_checked() -> None:
    batch = pack_samples(_samples(), PAD)
    # a: P=3, R=2, sequence length 5; b: P=1, R=3, length 4 -> L = 5, per-token columns L-1 = 4.
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9], [5, 8, 9, 10, PAD]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    assert batch.targets.tolist() == [[6, 7, 8, 9], [8, 9, 10, PAD]]
    # a's response sits at columns P-1..P+R-2 = 2..3; b's at 0..2.
    assert batch.loss_mask.tolist() == [[0, 0, 1, 1], [1, 1, 1, 0]]
    torch.testing.assert_close(
        batch.rollout_log_probs, torch.tensor([[0, 0, -0.1, -0.2], [-1.0, -2, -3, 0]])
    )
    assert batch.advantages.tolist() == [1.5, -0.5]
    # The masked targets are exactly the response tokens.
    for row, s in enumerate(_samples()):
        assert batch.targets[row][batch.loss_mask[row].bool()].tolist() == s.response_ids
    assert batch.input_ids.dtype == batch.targets.dtype == torch.long
    assert batch.loss_mask.dtype == batch.rollout_log_probs.dtype == torch.float32
    assert len(batch) == 2


def test_custom_loss_mask_respected() -> None:
    samples = _samples()
    samples[1].loss_mask = [1, 0, 1]  # e.g. an observation token in the middle of a turn
    batch = pack_samples(samples, PAD)
    assert batch.loss_mask.tolist() == [[0, 0, 1, 1], [1, 0, 1, 0]]


def test_empty_response_and_padding_value() -> None:
    empty = Sample([5, 6], [], [], 0, group_id=0, prompt_index=0)
    batch = pack_samples([empty, _samples()[1]], pad_id=3)
    assert batch.input_ids.tolist() == [[5, 6, 3, 3], [5, 8, 9, 10]]
    assert batch.loss_mask.tolist() == [[0, 0, 0], [1, 1, 1]]


def test_slice_and_empty() -> None:
    batch = pack_samples(_samples(), PAD)
    part = batch.slice(1, 2)
    assert part.input_ids.tolist() == [[5, 8, 9, 10, PAD]] and part.advantages.tolist() == [-0.5]
    with pytest.raises(ValueError, match="empty list"):
        pack_samples([], PAD)


def test_a_slice_trimmed_drops_the_columns_no_row_reaches() -> None:
    samples = _samples()
    for s in samples:
        s.old_log_probs = [-0.5] * len(s.response_ids)
    batch = pack_samples(samples, PAD)
    assert batch.trimmed() is batch  # row a fills all 5 columns
    part = batch.slice(1, 2).trimmed()  # b: length 4 of the batch's 5
    assert part.input_ids.tolist() == [[5, 8, 9, 10]] and part.attention_mask.tolist() == [[1, 1, 1, 1]]
    assert part.targets.tolist() == [[8, 9, 10]] and part.loss_mask.tolist() == [[1, 1, 1]]
    torch.testing.assert_close(part.rollout_log_probs, torch.tensor([[-1.0, -2.0, -3.0]]))
    assert part.old_log_probs is not None and part.old_log_probs.tolist() == [[-0.5, -0.5, -0.5]]
    assert part.advantages.tolist() == [-0.5]  # per sequence: untouched
    # Per-token advantages (GAE) are cut with the other per-token fields; one column always stays.
    short = pack_samples([Sample([5], [], [], 0, group_id=0, prompt_index=0), samples[0]], PAD)
    short.advantages = torch.arange(8.0).reshape(2, 4)
    one = short.slice(0, 1).trimmed()
    assert one.input_ids.tolist() == [[5, PAD]] and one.advantages.tolist() == [[0.0]]


def test_a_per_token_field_of_the_wrong_length_is_refused_naming_the_sample() -> None:
    # A value too many for sample 0 would shift into sample 1's columns were it not checked.
    a, b = _samples()
    a.old_log_probs, b.old_log_probs = [-0.1, -0.2, -0.3], [-1.0, -2.0]
    with pytest.raises(ValueError, match="sample 0 has 3 per-token values for its 2 response tokens"):
        pack_samples([a, b], PAD)
    a.old_log_probs = [-0.1, -0.2]
    with pytest.raises(ValueError, match="sample 1 has 2 per-token values for its 3 response tokens"):
        pack_samples([a, b], PAD)
