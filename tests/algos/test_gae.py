"""GAE, returns, masked whitening, the clipped value loss and explained variance, by hand and
against veRL's published formulas (compute_gae_advantage_return, masked_whiten, compute_value_loss)."""

from __future__ import annotations

import math

import pytest
import torch

from relax_hpc.algos.gae import (
    explained_variance,
    gae_advantages_returns,
    gae_step,
    masked_whiten,
    terminal_rewards,
    token_moments,
    value_loss,
    value_metrics,
    value_moments,
    whiten_by_moments,
)


def test_terminal_reward_sits_on_the_last_trained_token() -> None:
    mask = torch.tensor([[1, 1, 0], [1, 0, 1], [0, 0, 0]])
    out = terminal_rewards(torch.tensor([2.0, -1.0, 5.0]), mask)
    # row 0: last trained token is t=1; row 1: t=2 (the hole at t=1 is an observation); row 2: none
    assert out.tolist() == [[0.0, 2.0, 0.0], [0.0, 0.0, -1.0], [0.0, 0.0, 0.0]]


def test_gae_with_gamma_and_lambda_one_gives_the_outcome_reward_as_return() -> None:
    values = torch.tensor([[0.5, 0.2, 0.4]], dtype=torch.float64)
    mask = torch.ones(1, 3)
    adv, ret = gae_advantages_returns(terminal_rewards(torch.tensor([1.0]), mask), values, mask, 1.0, 1.0)
    # t=2: delta = 1 + 0 - 0.4 = 0.6, A2 = 0.6
    # t=1: delta = 0 + 0.4 - 0.2 = 0.2, A1 = 0.2 + 0.6 = 0.8
    # t=0: delta = 0 + 0.2 - 0.5 = -0.3, A0 = -0.3 + 0.8 = 0.5
    assert adv.flatten().tolist() == pytest.approx([0.5, 0.8, 0.6], abs=1e-12)
    # R = A + V = 1 everywhere: with gamma = lam = 1 the return is the reward
    assert ret.flatten().tolist() == pytest.approx([1.0, 1.0, 1.0], abs=1e-12)


def test_gae_discounts_and_skips_masked_tokens_and_padding() -> None:
    values = torch.tensor([[0.5, 0.2, 0.4], [0.5, 9.0, 0.4], [0.1, 0.3, 7.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 1], [1, 1, 0]])
    rewards = torch.tensor([1.0, 1.0, 0.0])
    adv, ret = gae_advantages_returns(terminal_rewards(rewards, mask), values, mask, 0.9, 0.5)
    # gamma * lam = 0.45
    # row 0: A2 = 1 - 0.4 = 0.6; A1 = 0.9*0.4 - 0.2 + 0.45*0.6 = 0.16 + 0.27 = 0.43;
    #        A0 = 0.9*0.2 - 0.5 + 0.45*0.43 = -0.32 + 0.1935 = -0.1265; R = A + V = 0.3735, 0.63, 1.0
    # row 1: t=1 is masked (value 9 never read): A2 = 0.6; A0 = 0.9*0.4 - 0.5 + 0.45*0.6 = -0.14 + 0.27
    #        = 0.13; R0 = 0.63, R2 = 1.0, the masked token 0
    # row 2: t=2 is padding: reward 0 on t=1: A1 = 0 - 0.3 = -0.3; A0 = 0.9*0.3 - 0.1 + 0.45*(-0.3)
    #        = 0.17 - 0.135 = 0.035; R0 = 0.135, R1 = 0.0
    assert adv.flatten().tolist() == pytest.approx([-0.1265, 0.43, 0.6, 0.13, 0.0, 0.6, 0.035, -0.3, 0.0], abs=1e-12)
    assert ret.flatten().tolist() == pytest.approx([0.3735, 0.63, 1.0, 0.63, 0.0, 1.0, 0.135, 0.0, 0.0], abs=1e-12)


def test_masked_whiten_uses_only_trained_tokens() -> None:
    values = torch.tensor([[1.0, 2.0], [3.0, 100.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    # trained values 1, 2, 3: mean 2, var = (1 + 0 + 1) / (3 - 1) = 1 -> (x - 2) / sqrt(1 + 1e-8)
    assert masked_whiten(values, mask).flatten().tolist() == pytest.approx([-1.0, 0.0, 1.0, 0.0], abs=1e-6)
    assert masked_whiten(values, torch.tensor([[1, 0], [0, 0]])).tolist() == [[0.0, 0.0], [0.0, 0.0]]


def test_clipped_value_loss_by_hand() -> None:
    pred = torch.tensor([[1.0, 0.8]], requires_grad=True)
    old, ret, mask = torch.tensor([[0.5, 0.5]]), torch.tensor([[2.0, 0.0]]), torch.ones(1, 2)
    terms = value_loss(pred, old, ret, mask, clip_eps=0.2)
    # token 0: (1 - 2)^2 = 1; clipped 0.7: (0.7 - 2)^2 = 1.69 -> 1.69 (the clipped branch)
    # token 1: (0.8 - 0)^2 = 0.64; clipped 0.7: 0.49 -> 0.64 (the unclipped branch)
    # loss = 0.5 * (1.69 + 0.64) / 2 = 0.5825; clip_frac = 1/2; value_error = (1 + 0.64) / 2 = 0.82
    assert terms.loss.item() == pytest.approx(0.5825, abs=1e-6)
    assert terms.clip_frac == pytest.approx(0.5)
    assert terms.value_error == pytest.approx(0.82, abs=1e-6)
    terms.loss.backward()
    # token 0's clipped value is a constant: no gradient; token 1: 0.5 * 2 * 0.8 / 2 = 0.4
    assert pred.grad is not None and pred.grad.flatten().tolist() == pytest.approx([0.0, 0.4], abs=1e-6)
    unclipped = value_loss(pred.detach(), old, ret, mask, clip_eps=None)
    assert unclipped.loss.item() == pytest.approx(0.5 * (1 + 0.64) / 2, abs=1e-6) and unclipped.clip_frac == 0.0


def test_explained_variance_by_hand() -> None:
    values, returns = torch.tensor([[1.0, 2.0, 3.0, 50.0]]), torch.tensor([[1.0, 2.0, 4.0, -7.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    # R - V = 0, 0, 1: var = ((1/3)^2 + (1/3)^2 + (2/3)^2) / 2 = 1/3; var(R) over 1, 2, 4 = 42/9 / 2 = 7/3
    # EV = 1 - (1/3) / (7/3) = 6/7
    assert explained_variance(values, returns, mask) == pytest.approx(6 / 7, abs=1e-6)
    assert math.isnan(explained_variance(values, torch.ones(1, 4), mask))


# veRL's published formulas, written out from their definitions (verl/trainer/ppo/core_algos.py,
# verl/utils/torch_functional.py) for a right-padded batch whose padding values are 0.
def _verl_gae(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
              lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    last, rev = 0.0, []
    length = values.shape[1]
    for t in reversed(range(length)):
        nxt = values[:, t + 1] if t < length - 1 else 0.0
        delta = token_rewards[:, t] + gamma * nxt - values[:, t]
        last = delta + gamma * lam * last
        rev.append(last)
    adv = torch.stack(rev[::-1], dim=1)
    returns = adv + values
    mean = (adv * mask).sum() / mask.sum()
    var = (((adv - mean) ** 2) * mask).sum() / (mask.sum() - 1)
    return (adv - mean) * torch.rsqrt(var + 1e-8), returns


def _verl_value_loss(vpreds: torch.Tensor, returns: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                     cliprange: float) -> tuple[float, float]:
    clipped = torch.clamp(vpreds, values - cliprange, values + cliprange)
    l1, l2 = (vpreds - returns) ** 2, (clipped - returns) ** 2
    loss = 0.5 * (torch.max(l1, l2) * mask).sum() / mask.sum()
    return float(loss), float((torch.gt(l2, l1).float() * mask).sum() / mask.sum())


def test_gae_and_value_loss_agree_with_verl_on_a_padded_batch() -> None:
    gen = torch.Generator().manual_seed(0)
    lengths = [7, 3, 5, 1, 6]
    mask = torch.tensor([[1.0] * n + [0.0] * (7 - n) for n in lengths], dtype=torch.float64)
    values = torch.randn(5, 7, generator=gen, dtype=torch.float64) * mask
    rewards = torch.randn(5, generator=gen, dtype=torch.float64)
    adv, ret = gae_step(rewards, values, mask, gamma=0.97, lam=0.9)
    want_adv, want_ret = _verl_gae(terminal_rewards(rewards, mask), values, mask, 0.97, 0.9)
    keep = mask.bool()
    assert torch.allclose(adv[keep], want_adv[keep], atol=1e-6)
    assert torch.allclose(ret[keep], want_ret[keep], atol=1e-6)
    pred = values + 0.3 * torch.randn(5, 7, generator=gen, dtype=torch.float64)
    terms = value_loss(pred, values, ret, mask, clip_eps=0.2)
    want_loss, want_frac = _verl_value_loss(pred, ret, values, mask, 0.2)
    assert terms.loss.item() == pytest.approx(want_loss, abs=1e-6)
    assert terms.clip_frac == pytest.approx(want_frac, abs=1e-6)


def test_moments_summed_over_shards_whiten_and_measure_as_the_whole_step() -> None:
    # x = [[1, 2, 9], [3, -, 5]] over the trained tokens (the masked 9 and the hole are skipped):
    # n = 4, sum = 11, sum of squares = 1 + 4 + 9 + 25 = 39, mean 2.75,
    # var = (39 - 11 * 2.75) / 3 = 8.75 / 3, so token 1 whitens to (1 - 2.75) / sqrt(8.75 / 3 + 1e-8).
    x = torch.tensor([[1.0, 2.0, 9.0], [3.0, 7.0, 5.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    moments = token_moments(x[:1], mask[:1]) + token_moments(x[1:], mask[1:])  # two ranks' shards
    assert moments.tolist() == [4.0, 11.0, 39.0]
    shards = torch.cat([whiten_by_moments(x[:1], mask[:1], moments), whiten_by_moments(x[1:], mask[1:], moments)])
    assert torch.allclose(shards, masked_whiten(x, mask), atol=1e-12)
    assert shards[0, 0].item() == pytest.approx(-1.75 / math.sqrt(8.75 / 3 + 1e-8), abs=1e-7)
    assert shards[0, 2].item() == 0.0 and shards[1, 1].item() == 0.0
    assert whiten_by_moments(x, mask, token_moments(x[:1, :1], mask[:1, :1])).abs().sum() == 0  # one token
    values = torch.tensor([[0.5, 1.0, 0.0], [2.0, 0.0, 4.0]])
    summed = value_moments(values[:1], x[:1], mask[:1]) + value_moments(values[1:], x[1:], mask[1:])
    metrics = value_metrics(summed)
    assert metrics["explained_variance"] == pytest.approx(explained_variance(values, x, mask), abs=1e-12)
    assert metrics["values_mean"] == pytest.approx(7.5 / 4) and metrics["returns_mean"] == pytest.approx(2.75)
    assert math.isnan(value_metrics(value_moments(values, torch.full((2, 3), 0.3), mask))["explained_variance"])
