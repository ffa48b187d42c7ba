"""Hand-worked checks of the four KL penalty estimators."""

from __future__ import annotations

import pytest
import torch

from relax_hpc.algos.kl import KL_ESTIMATORS, kl_penalty

LOGP = torch.tensor([[-1.0, -0.5]])
REF = torch.tensor([[-0.5, -1.0]])


def test_k1_is_log_ratio() -> None:
    # logp - ref = (-1 + 0.5, -0.5 + 1) = (-0.5, 0.5)
    torch.testing.assert_close(kl_penalty(LOGP, REF, "k1"), torch.tensor([[-0.5, 0.5]]))


def test_k2_is_half_squared_log_ratio() -> None:
    # 0.5 * (+-0.5)^2 = 0.125
    torch.testing.assert_close(kl_penalty(LOGP, REF, "k2"), torch.tensor([[0.125, 0.125]]))


def test_k3_and_low_var_kl_agree_in_range() -> None:
    # x = ref - logp = (0.5, -0.5)
    # exp(0.5) - 0.5 - 1 = 1.648721 - 1.5 = 0.148721
    # exp(-0.5) + 0.5 - 1 = 0.606531 - 0.5 = 0.106531
    expected = torch.tensor([[0.148721, 0.106531]])
    torch.testing.assert_close(kl_penalty(LOGP, REF, "k3"), expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(kl_penalty(LOGP, REF, "low_var_kl"), expected, atol=1e-6, rtol=0)


def test_low_var_kl_clamps_extreme_tokens_to_ten() -> None:
    logp = torch.tensor([[-30.0, 0.0]])
    ref = torch.tensor([[0.0, -30.0]])
    # k3: x = 30 -> exp(30) - 31 = 1.0686e13 ; x = -30 -> exp(-30) + 30 - 1 = 29.0
    k3 = kl_penalty(logp, ref, "k3")
    torch.testing.assert_close(k3[0, 1], torch.tensor(29.0))
    assert k3[0, 0] > 1e12
    # low_var_kl: x clamped to +-20 first, then the result to [-10, 10] -> both 10
    torch.testing.assert_close(kl_penalty(logp, ref, "low_var_kl"), torch.tensor([[10.0, 10.0]]))


def test_gradient_flows_to_policy_only() -> None:
    logp = LOGP.clone().requires_grad_(True)
    ref = REF.clone().requires_grad_(True)
    kl_penalty(logp, ref, "k2").sum().backward()
    # d/dlogp 0.5 * (logp - ref)^2 = logp - ref = (-0.5, 0.5); the reference gets none
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.5, 0.5]]))
    assert ref.grad is None


def test_unknown_estimator_lists_allowed() -> None:
    assert KL_ESTIMATORS == ("k1", "k2", "k3", "low_var_kl")
    with pytest.raises(ValueError, match=r"'k4'.*kl_estimator.*k1, k2, k3, low_var_kl"):
        kl_penalty(LOGP, REF, "k4")
