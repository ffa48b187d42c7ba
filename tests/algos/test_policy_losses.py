"""Hand-worked checks of each registered policy loss: PPO-clip (grpo/dr_grpo/opd), GSPO, SAPO.

Convention in these tests: old_logp = 0, so ratio r = exp(logp) and logp = ln r.
With seq_mean_token_mean over B rows of n trained tokens, d(loss)/d(logp_t) is
the per-token derivative divided by n * B; the per-token derivative of
-A * r w.r.t. logp is -A * r (because dr/dlogp = r).
"""

from __future__ import annotations

import math

import pytest
import torch

from relax_hpc.algos.losses import LossInputs, policy_loss
from relax_hpc.spec.schema import AlgorithmSpec


def inputs_from_ratios(ratios: list[list[float]], advantages: list[float], mask: list[list[int]] | None = None) -> LossInputs:
    logp = torch.tensor([[math.log(r) for r in row] for row in ratios], requires_grad=True)
    mask_t = torch.ones_like(logp) if mask is None else torch.tensor(mask, dtype=torch.float32)
    return LossInputs(logp=logp, old_logp=torch.zeros_like(logp), advantages=torch.tensor(advantages), mask=mask_t)


def grad_of(loss: torch.Tensor, inputs: LossInputs) -> torch.Tensor:
    loss.backward()
    assert inputs.logp.grad is not None
    return inputs.logp.grad


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "opd"])
def test_ppo_clip_both_sides_positive_and_negative_advantage(name: str) -> None:
    inputs = inputs_from_ratios([[1.5, 1.1, 0.5], [1.5, 0.5, 0.9]], [2.0, -1.0])
    loss, stats = policy_loss(AlgorithmSpec(name=name), inputs)
    # row 0, A = +2, clip range [0.8, 1.2]:
    #   r=1.5: max(-3.0, -1.2*2 = -2.4) = -2.4 (clipped, no grad)
    #   r=1.1: max(-2.2, -2.2)          = -2.2 (grad -A*r = -2.2)
    #   r=0.5: max(-1.0, -0.8*2 = -1.6) = -1.0 (unclipped: grad -1.0)
    # row 1, A = -1:
    #   r=1.5: max(1.5, 1.2) = 1.5 (unclipped: grad -A*r = 1.5)
    #   r=0.5: max(0.5, 0.8) = 0.8 (clipped, no grad)
    #   r=0.9: max(0.9, 0.9) = 0.9 (grad 0.9)
    # row means: -5.6/3 = -1.866667, 3.2/3 = 1.066667; mean of rows = -0.8/2 = -0.4
    assert loss.item() == pytest.approx(-0.4, abs=1e-6)
    assert stats["loss/policy"] == pytest.approx(-0.4, abs=1e-6)
    assert stats["clip_frac"] == pytest.approx(2 / 6)  # 2 clipped tokens of 6
    assert stats["ratio_mean"] == pytest.approx(1.0)  # (1.5+1.1+0.5+1.5+0.5+0.9)/6 = 6/6
    # gradients divided by n*B = 3*2 = 6: (0, -2.2/6, -1.0/6), (1.5/6, 0, 0.9/6)
    expected = torch.tensor([[0.0, -0.366667, -0.166667], [0.25, 0.0, 0.15]])
    torch.testing.assert_close(grad_of(loss, inputs), expected, atol=1e-6, rtol=0)


def test_clip_higher_uses_separate_upper_eps() -> None:
    # r = 1.25, A = +1: eps_high 0.2 -> clipped at 1.2: loss -1.2, grad 0
    tight = inputs_from_ratios([[1.25]], [1.0])
    loss, stats = policy_loss(AlgorithmSpec(clip_eps_high=0.2), tight)
    assert loss.item() == pytest.approx(-1.2)
    assert stats["clip_frac"] == 1.0
    assert grad_of(loss, tight).item() == 0.0
    # eps_high 0.28 (DAPO clip-higher) -> 1.25 < 1.28 is inside: loss -1.25, grad -A*r = -1.25
    loose = inputs_from_ratios([[1.25]], [1.0])
    loss, stats = policy_loss(AlgorithmSpec(clip_eps_high=0.28), loose)
    assert loss.item() == pytest.approx(-1.25)
    assert stats["clip_frac"] == 0.0
    assert grad_of(loss, loose).item() == pytest.approx(-1.25)


def test_ratio_far_outside_clip_range_has_zero_gradient_only_where_clipped() -> None:
    far = math.exp(5.0)  # r = e^5 = 148.413159
    # A = +1: max(-148.41, -1.2) = -1.2 -> clipped, grad exactly 0
    pos = inputs_from_ratios([[far]], [1.0])
    loss, _ = policy_loss(AlgorithmSpec(), pos)
    assert loss.item() == pytest.approx(-1.2)
    assert grad_of(loss, pos).item() == 0.0
    # A = -1: max(148.41, 1.2) = 148.41 -> the unclipped branch wins, grad -A*r = 148.41
    neg = inputs_from_ratios([[far]], [-1.0])
    loss, _ = policy_loss(AlgorithmSpec(), neg)
    assert loss.item() == pytest.approx(148.413159, rel=1e-6)
    assert grad_of(loss, neg).item() == pytest.approx(148.413159, rel=1e-6)


def test_log_ratio_is_bounded_so_loss_stays_finite() -> None:
    logp = torch.tensor([[100.0]], requires_grad=True)
    inputs = LossInputs(logp=logp, old_logp=torch.zeros(1, 1), advantages=torch.tensor([-1.0]), mask=torch.ones(1, 1))
    loss, _ = policy_loss(AlgorithmSpec(), inputs)
    # log-ratio 100 is clamped to 20: loss = exp(20) = 4.851652e8 (instead of inf)
    assert loss.item() == pytest.approx(math.exp(20.0), rel=1e-6)


def test_dual_clip_caps_negative_advantage_loss_at_c_times_abs_a() -> None:
    cfg = AlgorithmSpec(dual_clip_c=3.0)
    far = math.exp(5.0)
    # A = -1, r = 148.41: PPO gives 148.41; dual-clip min(148.41, -c*A = 3.0) = 3.0, grad 0
    neg = inputs_from_ratios([[far]], [-1.0])
    loss, stats = policy_loss(cfg, neg)
    assert loss.item() == pytest.approx(3.0)
    assert stats["clip_frac"] == 1.0
    assert grad_of(loss, neg).item() == 0.0
    # A = -1, r = 1.5: PPO gives 1.5 < 3.0 -> unchanged, grad 1.5
    mid = inputs_from_ratios([[1.5]], [-1.0])
    loss, _ = policy_loss(cfg, mid)
    assert loss.item() == pytest.approx(1.5)
    assert grad_of(loss, mid).item() == pytest.approx(1.5)
    # A = +1 is never dual-clipped: r = 148.41 -> -1.2 as in plain PPO
    pos = inputs_from_ratios([[far]], [1.0])
    loss, _ = policy_loss(cfg, pos)
    assert loss.item() == pytest.approx(-1.2)


def test_gspo_uses_one_masked_sequence_ratio_per_response() -> None:
    logp = torch.tensor([[0.2, -0.1, 7.0], [-0.3, -0.3, -0.3]], requires_grad=True)
    inputs = LossInputs(
        logp=logp,
        old_logp=torch.zeros(2, 3),
        advantages=torch.tensor([1.0, 1.0]),
        mask=torch.tensor([[1, 1, 0], [1, 1, 1]]),
    )
    loss, stats = policy_loss(AlgorithmSpec(name="gspo", clip_eps_low=0.1, clip_eps_high=0.1), inputs)
    # row 0: mean log-ratio over trained tokens = (0.2 - 0.1)/2 = 0.05 (the masked 7.0 is ignored)
    #        s_0 = exp(0.05) = 1.051271, inside [0.9, 1.1] -> every token -1.051271
    # row 1: s_1 = exp(-0.3) = 0.740818 < 0.9 with A > 0 -> unclipped -0.740818
    # mean of rows = (-1.051271 - 0.740818)/2 = -0.896045
    assert loss.item() == pytest.approx(-0.896045, abs=1e-6)
    # ratio_mean over the 5 trained tokens: (2*1.051271 + 3*0.740818)/5 = 0.864999
    assert stats["ratio_mean"] == pytest.approx(0.864999, abs=1e-6)
    assert stats["clip_frac"] == 0.0
    # gradient: d/dlogp_t of -A*s_i*exp(logp_t - sg(logp_t)) = -s_i, divided by n_i * B
    #   row 0: -1.051271/(2*2) = -0.262818; the same as d/dlogp_t of -exp(mean_t logp_t)/B
    #   row 1: -0.740818/(3*2) = -0.123470
    expected = torch.tensor([[-0.262818, -0.262818, 0.0], [-0.123470, -0.123470, -0.123470]])
    torch.testing.assert_close(grad_of(loss, inputs), expected, atol=1e-6, rtol=0)


def test_gspo_narrow_clip_cuts_whole_sequence() -> None:
    cfg = AlgorithmSpec(name="gspo", clip_eps_low=3e-4, clip_eps_high=4e-4)
    # s = exp((0.2 - 0.1)/2) = 1.051271 > 1.0004
    # A = +1: max(-1.051271, -1.0004) = -1.0004 clipped, grad 0 on every token
    pos = LossInputs(logp=torch.tensor([[0.2, -0.1]], requires_grad=True), old_logp=torch.zeros(1, 2),
                     advantages=torch.tensor([1.0]), mask=torch.ones(1, 2))
    loss, stats = policy_loss(cfg, pos)
    assert loss.item() == pytest.approx(-1.0004)
    assert stats["clip_frac"] == 1.0
    assert torch.equal(grad_of(loss, pos), torch.zeros(1, 2))
    # A = -1: max(1.051271, 1.0004) = 1.051271 unclipped; grad s/n = 1.051271/2 = 0.525636
    neg = LossInputs(logp=torch.tensor([[0.2, -0.1]], requires_grad=True), old_logp=torch.zeros(1, 2),
                     advantages=torch.tensor([-1.0]), mask=torch.ones(1, 2))
    loss, _ = policy_loss(cfg, neg)
    assert loss.item() == pytest.approx(1.051271, abs=1e-6)
    torch.testing.assert_close(grad_of(loss, neg), torch.tensor([[0.525636, 0.525636]]), atol=1e-6, rtol=0)


def test_sapo_positive_advantage_uses_tau_pos() -> None:
    inputs = inputs_from_ratios([[1.0, 1.5]], [1.0])
    loss, stats = policy_loss(AlgorithmSpec(name="sapo", sapo_tau_pos=1.0), inputs)
    # r = 1:   f = (4/1)*sigmoid(0) = 2.0 -> loss -2.0
    # r = 1.5: f = 4*sigmoid(0.5) = 4*0.622459 = 2.489837 -> loss -2.489837
    # mean = -4.489837/2 = -2.244919
    assert loss.item() == pytest.approx(-2.244919, abs=1e-6)
    assert stats["clip_frac"] == 0.0
    # d loss_t/d logp_t = -A * f'(r) * r with f'(r) = 4*s*(1-s):
    #   r = 1:   -4*0.5*0.5*1 = -1.0 (on-policy: plain policy-gradient weight) -> /2 = -0.5
    #   r = 1.5: -4*0.622459*0.377541*1.5 = -1.410022 -> /2 = -0.705011
    torch.testing.assert_close(grad_of(loss, inputs), torch.tensor([[-0.5, -0.705011]]), atol=1e-6, rtol=0)


def test_sapo_non_positive_advantage_uses_tau_neg() -> None:
    inputs = inputs_from_ratios([[1.5], [1.0]], [-1.0, -0.5])
    loss, _ = policy_loss(AlgorithmSpec(name="sapo", sapo_tau_neg=1.05), inputs)
    # row 0: s = sigmoid(1.05*0.5) = sigmoid(0.525) = 0.628316; f = (4/1.05)*0.628316 = 2.393585
    #        loss = -f*A = +2.393585
    # row 1: r = 1 -> f = (4/1.05)*0.5 = 1.904762; loss = 0.5*1.904762 = 0.952381
    #        (tau_pos = 1.0 would give 2.0*0.5 = 1.0: this pins the branch)
    # mean = (2.393585 + 0.952381)/2 = 1.672983
    assert loss.item() == pytest.approx(1.672983, abs=1e-6)
    # grads: row 0: -A*4*s*(1-s)*r = 4*0.628316*0.371684*1.5 = 1.401210, /2 = 0.700605
    #        row 1: 0.5*4*0.25*1 = 0.5, /2 = 0.25
    torch.testing.assert_close(grad_of(loss, inputs), torch.tensor([[0.700605], [0.25]]), atol=1e-6, rtol=0)
