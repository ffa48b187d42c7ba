"""Hand-worked checks of the two loss aggregation modes, including masked-out sequences and an
explicit denominator (the count of a whole optimizer step split into micro-batches)."""

from __future__ import annotations

import math

import pytest
import torch

from relax_hpc.algos.aggregation import aggregate, loss_denominator, masked_token_mean, masked_token_means

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


def test_loss_denominator_counts_tokens_or_sequences() -> None:
    # token_mean: trained tokens 3 + 1 + 0 = 4; seq_mean_token_mean: B = 3 (the masked row counts)
    assert loss_denominator(MASK, "token_mean") == 4.0
    assert loss_denominator(MASK.float(), "seq_mean_token_mean") == 3.0
    assert loss_denominator(torch.zeros(2, 3), "token_mean") == 0.0  # not clamped: counts add up


def test_explicit_denominator_replaces_the_batch_count() -> None:
    # token_mean: (1 + 2 + 3 + 4) / 8 = 1.25
    assert aggregate(PER_TOKEN, MASK, "token_mean", denominator=8.0).item() == pytest.approx(1.25)
    # seq_mean_token_mean: sequence means 2 + 4 + 0 = 6, / 4 = 1.5
    assert aggregate(PER_TOKEN, MASK, "seq_mean_token_mean", denominator=4.0).item() == pytest.approx(1.5)
    # None is the batch's own count: the same as passing loss_denominator
    for mode in ("token_mean", "seq_mean_token_mean"):
        own = aggregate(PER_TOKEN, MASK, mode, denominator=loss_denominator(MASK, mode))
        assert own.item() == pytest.approx(aggregate(PER_TOKEN, MASK, mode).item())


@pytest.mark.parametrize(
    ("mode", "whole", "parts", "grad_row0", "grad_row1"),
    [
        # token_mean, denominator 4 tokens: row 0 gives (1+2+3)/4 = 1.5, rows 1-2 give 4/4 = 1.0;
        # 1.5 + 1.0 = 2.5 = the whole batch's 10/4. Every trained token's gradient is 1/4.
        ("token_mean", 2.5, (1.5, 1.0), [0.25, 0.25, 0.25], [0.25, 0.0, 0.0]),
        # seq_mean_token_mean, denominator 3 sequences: row 0 gives 2/3, rows 1-2 give (4+0)/3;
        # 2/3 + 4/3 = 2.0 = the whole batch's 6/3. Gradients 1/(3 tokens * 3) and 1/(1 token * 3).
        ("seq_mean_token_mean", 2.0, (2 / 3, 4 / 3), [1 / 9, 1 / 9, 1 / 9], [1 / 3, 0.0, 0.0]),
    ],
)
def test_micro_batches_with_the_step_denominator_add_up_to_the_whole_batch(
    mode: str, whole: float, parts: tuple[float, float], grad_row0: list[float], grad_row1: list[float]
) -> None:
    values = PER_TOKEN.clone().requires_grad_(True)
    denominator = loss_denominator(MASK[:1], mode) + loss_denominator(MASK[1:], mode)
    first = aggregate(values[:1], MASK[:1], mode, denominator)
    rest = aggregate(values[1:], MASK[1:], mode, denominator)
    assert (first.item(), rest.item()) == (pytest.approx(parts[0]), pytest.approx(parts[1]))
    assert (first + rest).item() == pytest.approx(whole)
    assert aggregate(PER_TOKEN, MASK, mode).item() == pytest.approx(whole)
    (first + rest).backward()
    assert values.grad is not None
    expected = torch.tensor([grad_row0, grad_row1, [0.0, 0.0, 0.0]])
    torch.testing.assert_close(values.grad, expected)


@pytest.mark.parametrize("bad", [0.0, -2.0, math.nan, math.inf])
def test_denominator_must_be_a_positive_count(bad: float) -> None:
    with pytest.raises(ValueError, match=r"denominator = .*finite count > 0"):
        aggregate(PER_TOKEN, MASK, "token_mean", denominator=bad)


def test_masked_token_means_are_each_tensors_mean_over_the_mask_worked_by_hand() -> None:
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])  # three tokens
    ratio = torch.tensor([[1.0, 2.0, 99.0], [3.0, -7.0, float("nan")]])  # outside the mask: ignored
    clipped = torch.tensor([[True, False, True], [True, True, True]]).float()
    means = masked_token_means(mask, {"ratio_mean": ratio, "clip_frac": clipped})
    assert list(means) == ["ratio_mean", "clip_frac"]
    assert means["ratio_mean"] == pytest.approx((1 + 2 + 3) / 3)
    assert means["clip_frac"] == pytest.approx(2 / 3)
    assert means == pytest.approx({"ratio_mean": masked_token_mean(ratio, mask),
                                   "clip_frac": masked_token_mean(clipped, mask)})
    # No token kept: 0, as masked_token_mean gives, not NaN.
    assert masked_token_means(torch.zeros(2, 3), {"ratio_mean": ratio}) == {"ratio_mean": 0.0}
    with pytest.raises(ValueError, match=r"ratio_mean has shape \(3,\).*\[B, T\]"):
        masked_token_means(mask, {"ratio_mean": torch.ones(3)})
