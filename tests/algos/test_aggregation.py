"""Hand-worked checks of the two loss aggregation modes, including masked-out sequences."""

from __future__ import annotations

import math

import pytest
import torch

from relax_hpc.algos.aggregation import aggregate

PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])


def test_seq_mean_token_mean_counts_fully_masked_sequence_as_zero() -> None:
    # sequence means: (1+2+3)/3 = 2, 4/1 = 4, fully masked -> 0; mean over B=3: 6/3 = 2.0
    assert aggregate(PER_TOKEN, MASK, "seq_mean_token_mean").item() == pytest.approx(2.0)


def test_token_mean_averages_trained_tokens_of_batch() -> None:
    # (1 + 2 + 3 + 4) / 4 trained tokens = 2.5
    assert aggregate(PER_TOKEN, MASK.bool(), "token_mean").item() == pytest.approx(2.5)


def test_nan_and_inf_in_padding_do_not_leak() -> None:
    values = PER_TOKEN.clone()
    values[1, 1] = math.nan
    values[2, 0] = math.inf
    values.requires_grad_(True)
    out = aggregate(values, MASK.float(), "seq_mean_token_mean")
    assert out.item() == pytest.approx(2.0)
    out.backward()
    # d/dx: 1/(3*3) for row 0, 1/(1*3) for token (1,0), 0 elsewhere
    assert values.grad is not None
    expected = torch.tensor([[1 / 9, 1 / 9, 1 / 9], [1 / 3, 0.0, 0.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(values.grad, expected)


@pytest.mark.parametrize("mode", ["seq_mean_token_mean", "token_mean"])
def test_all_masked_batch_is_zero_with_zero_grad(mode: str) -> None:
    values = torch.tensor([[5.0, -1.0]], requires_grad=True)
    out = aggregate(values, torch.zeros(1, 2), mode)
    assert out.item() == 0.0
    out.backward()
    assert values.grad is not None and torch.equal(values.grad, torch.zeros(1, 2))


def test_unknown_mode_and_shape_mismatch_are_explained() -> None:
    with pytest.raises(ValueError, match=r"'sum'.*loss_agg.*seq_mean_token_mean, token_mean"):
        aggregate(PER_TOKEN, MASK, "sum")
    with pytest.raises(ValueError, match=r"must be the same \[B, T\]"):
        aggregate(PER_TOKEN, MASK[:, :2], "token_mean")
