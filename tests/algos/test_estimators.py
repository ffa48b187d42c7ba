"""RLOO, REINFORCE++ (-baseline) and DAPO's overlong penalty against hand-worked values, and the
whitening against the peers' masked whitening computed on the tokens themselves."""

from __future__ import annotations

import math

from typing import get_args

import pytest
import torch

from relax_hpc.algos.estimators import (
    ESTIMATORS,
    group_centred,
    outcome_advantages,
    overlong_penalty,
    reinforce_pp_token_advantages,
    rloo_advantages,
    whiten_over_tokens,
)
from relax_hpc.spec.schema import AdvantageEstimator

TOL = 1e-6


def _close(got: torch.Tensor, want: list[float] | list[list[float]]) -> None:
    assert torch.allclose(got.double(), torch.tensor(want, dtype=torch.float64), atol=TOL), (got, want)


def test_rloo_subtracts_the_mean_of_the_other_samples() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.3, 0.5, 0.5])
    ids = [7, 7, 7, 7, 2, 9, 9]
    # group 7 (G = 4): r_0 = 1 against the mean of (0, 0, 1) = 1/3 -> 2/3; r_1 = 0 against (1, 0, 1) = 2/3 -> -2/3
    # group 2 alone: no other sample, no baseline -> 0; group 9 of equal rewards -> 0
    _close(rloo_advantages(rewards, ids), [2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.0, 0.0, 0.0])


def test_rloo_is_g_over_g_minus_one_times_the_centred_reward_in_any_order() -> None:
    rewards = torch.tensor([0.2, 0.9, 0.4, 0.1, 0.7])
    ids = [1, 0, 1, 0, 1]  # interleaved groups of 3 and 2
    centred = group_centred(rewards, ids)
    sizes = torch.tensor([3.0, 2.0, 3.0, 2.0, 3.0])
    _close(rloo_advantages(rewards, ids), (centred * sizes / (sizes - 1)).tolist())


def test_reinforce_pp_baseline_centres_by_group_then_whitens_over_trained_tokens() -> None:
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    ids = [0, 0, 1, 1]
    tokens = torch.tensor([2.0, 1.0, 1.0, 4.0])
    # centred: group 0 has mean 0.5 -> (0.5, -0.5); group 1 is all equal -> (0, 0)
    # over N = 8 tokens: mean = (2 * 0.5 + 1 * -0.5) / 8 = 0.0625
    # var = (2 * 0.4375^2 + 0.5625^2 + 0.0625^2 + 4 * 0.0625^2) / 7 = 0.71875 / 7
    std = math.sqrt(0.71875 / 7 + 1e-8)
    want = [0.4375 / std, -0.5625 / std, -0.0625 / std, -0.0625 / std]
    _close(outcome_advantages("reinforce_pp_baseline", rewards, ids, tokens), want)


def _masked_whiten_on_tokens(values: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The peers' form: each value tiled over its sample's tokens in a padded [B, T] grid, a masked
    mean, a masked variance with Bessel's correction, (x - mean) * rsqrt(var + 1e-8)."""
    width = max(counts)
    grid = values.double()[:, None].expand(-1, width).clone()
    mask = torch.tensor([[1.0] * n + [0.0] * (width - n) for n in counts], dtype=torch.float64)
    n = mask.sum()
    mean = (grid * mask).sum() / n
    var = (((grid - mean) ** 2) * mask).sum() / n * (n / (n - 1))
    return ((grid - mean) * torch.rsqrt(var + 1e-8))[:, 0]


def test_whitening_equals_the_masked_whitening_of_the_tiled_tokens() -> None:
    generator = torch.Generator().manual_seed(3)
    values = torch.randn(9, generator=generator, dtype=torch.float64)
    counts = [1, 4, 2, 7, 3, 3, 5, 1, 6]
    _close(whiten_over_tokens(values, torch.tensor(counts, dtype=torch.float64)),
           _masked_whiten_on_tokens(values, counts).tolist())


def test_a_sample_without_trained_tokens_neither_counts_nor_gets_a_value() -> None:
    values = torch.tensor([1.0, 0.0, 50.0])
    # the 50 has no trained token: it must not move the mean (0.5) nor the variance (0.5 over 2 tokens)
    std = math.sqrt(0.5 + 1e-8)
    _close(whiten_over_tokens(values, torch.tensor([1.0, 1.0, 0.0])), [0.5 / std, -0.5 / std, 0.0])
    _close(whiten_over_tokens(values, torch.tensor([1.0, 0.0, 0.0])), [0.0, 0.0, 0.0])  # one token: nothing to compare


def test_reinforce_pp_whitens_the_rewards_with_no_group() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0])
    # one token each: mean 1/3, var = ((2/3)^2 + 2 * (1/3)^2) / 2 = 1/3
    std = math.sqrt(1 / 3 + 1e-8)
    _close(outcome_advantages("reinforce_pp", rewards, [0, 1, 2], torch.ones(3)),
           [(2 / 3) / std, -(1 / 3) / std, -(1 / 3) / std])


def test_equal_rewards_give_zero_advantage_under_every_estimator() -> None:
    rewards = torch.full((6,), 0.7)
    ids = [0, 0, 0, 1, 1, 1]
    for estimator in ("group", "rloo", "reinforce_pp", "reinforce_pp_baseline"):
        _close(outcome_advantages(estimator, rewards, ids, torch.full((6,), 3.0)), [0.0] * 6)


def test_the_group_estimator_is_grpo() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    # mean 0.25, sample std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5
    _close(outcome_advantages("group", rewards, [0, 0, 0, 0], torch.ones(4)),
           [0.75 / (0.5 + 1e-6), -0.25 / (0.5 + 1e-6), -0.25 / (0.5 + 1e-6), -0.25 / (0.5 + 1e-6)])


def test_an_unknown_estimator_or_mismatched_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match=r"advantage = 'ppo' is not one of group, rloo"):
        outcome_advantages("ppo", torch.ones(2), [0, 0], torch.ones(2))
    with pytest.raises(ValueError, match="the critic role computes it"):
        outcome_advantages("gae", torch.ones(2), [0, 0], torch.ones(2))
    with pytest.raises(ValueError, match="2 rewards but 3 group ids"):
        rloo_advantages(torch.ones(2), [0, 0, 1])


def test_reinforce_pp_with_the_kl_in_the_reward_by_hand() -> None:
    rewards = torch.tensor([1.0, 0.0])
    kl = torch.tensor([[0.1, 0.2, 0.5], [0.3, 0.4, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # token rewards at kl_coef 0.5: row 0 (-0.05, -0.1 + 1 = 0.9), its outcome on its last trained
    # token; row 1 (-0.15). Returns (sum from t on): row 0 (0.85, 0.9), row 1 (-0.15).
    # Over the 3 trained tokens: mean = 1.6 / 3; var = sum((x - mean)^2) / 2
    returns = [0.85, 0.9, -0.15]
    mean = sum(returns) / 3
    std = math.sqrt(sum((x - mean) ** 2 for x in returns) / 2 + 1e-8)
    _close(reinforce_pp_token_advantages(rewards, kl, mask, kl_coef=0.5),
           [[(0.85 - mean) / std, (0.9 - mean) / std, 0.0], [(-0.15 - mean) / std, 0.0, 0.0]])


def test_reinforce_pp_without_kl_is_the_outcome_form() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.5])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1]])
    token = reinforce_pp_token_advantages(rewards, torch.zeros(3, 2), mask, kl_coef=0.0)
    outcome = outcome_advantages("reinforce_pp", rewards, [0, 1, 2], mask.sum(1).float())
    _close(token, (outcome[:, None] * mask).tolist())


def test_the_overlong_penalty_falls_linearly_over_the_buffer() -> None:
    # max_new_tokens 20, buffer 5: free up to 15 tokens, then -(L - 15) / 5
    assert overlong_penalty([10, 15, 16, 18, 20], 20, 5, 1.0) == pytest.approx([0.0, 0.0, -0.2, -0.6, -1.0])
    assert overlong_penalty([18], 20, 5, 0.5) == pytest.approx([-0.3])  # the factor scales it
    with pytest.raises(ValueError, match=r"overlong_buffer_len must be in \[1, max_new_tokens = 20\], got 21"):
        overlong_penalty([1], 20, 21, 1.0)


def test_the_estimators_are_the_specs_values() -> None:
    assert ESTIMATORS == get_args(AdvantageEstimator)
