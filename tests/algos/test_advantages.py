"""Hand-worked checks of group advantages (GRPO / Dr.GRPO) and on-policy distillation advantages."""

from __future__ import annotations

import pytest
import torch

from relax_hpc.algos.advantages import advantages_by_group, group_advantages, normalizes_std, opd_advantages


def test_group_advantages_use_sample_std_per_consecutive_group() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    adv = group_advantages(rewards, group_size=4)
    # group 1: mean 0.25, deviations (0.75, -0.25, -0.25, -0.25)
    #   sum of squares = 0.5625 + 3 * 0.0625 = 0.75; sample var = 0.75 / 3 = 0.25; std = 0.5
    #   0.75 / (0.5 + 1e-6) = 1.499997, -0.25 / 0.500001 = -0.499999
    #   (the population std 0.4330 would give 1.732051 instead: this pins unbiased=True)
    # group 2: mean 0.5, deviations +-0.5; sample var = 1.0 / 3; std = 0.577350
    #   0.5 / (0.577350 + 1e-6) = 0.866024
    expected = torch.tensor(
        [1.499997, -0.499999, -0.499999, -0.499999, 0.866024, 0.866024, -0.866024, -0.866024]
    )
    torch.testing.assert_close(adv, expected, atol=2e-6, rtol=0)


def test_all_equal_rewards_give_exact_zeros_not_nan() -> None:
    rewards = torch.tensor([3.0, 3.0, 3.0, 0.0, 0.0, 0.0])
    adv = group_advantages(rewards, group_size=3)
    # deviations are all 0; std 0 -> 0 / (0 + 1e-6) = 0 exactly
    assert torch.equal(adv, torch.zeros(6))


def test_dr_grpo_drops_std_division() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    adv = group_advantages(rewards, group_size=4, normalize_std=False)
    # mean 0.25 -> r - mean = (0.75, -0.25, -0.25, -0.25), no division
    torch.testing.assert_close(adv, torch.tensor([0.75, -0.25, -0.25, -0.25]))
    assert normalizes_std("dr_grpo") is False
    assert normalizes_std("grpo") is True


def test_group_of_one_is_zero_not_nan() -> None:
    # each reward is its own group mean -> 0 (the sample std of one value is undefined)
    adv = group_advantages(torch.tensor([5.0, -2.0]), group_size=1)
    assert torch.equal(adv, torch.zeros(2))


def test_incomplete_group_is_rejected_with_group_size_in_message() -> None:
    with pytest.raises(ValueError, match=r"5 rewards is not a whole number of groups of 4"):
        group_advantages(torch.zeros(5), group_size=4)
    with pytest.raises(ValueError, match="group_size must be >= 1"):
        group_advantages(torch.zeros(4), group_size=0)


def test_opd_advantages_subtract_scaled_student_teacher_gap() -> None:
    student = torch.tensor([[-1.0, -2.0, -0.5]])
    teacher = torch.tensor([[-0.5, -2.5, -9.0]])
    mask = torch.tensor([[1, 1, 0]])
    adv = opd_advantages(torch.tensor([1.0]), student, teacher, mask, coef=0.5)
    # gap = student - teacher = (-0.5, 0.5, masked)
    # A_t = 1 - 0.5 * gap = (1 + 0.25, 1 - 0.25, 0 because masked) = (1.25, 0.75, 0.0)
    torch.testing.assert_close(adv, torch.tensor([[1.25, 0.75, 0.0]]))


def test_opd_advantages_accept_per_token_advantages_and_are_detached() -> None:
    student = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    teacher = torch.tensor([[-2.0, 0.0]])
    per_token = torch.tensor([[0.5, -0.5]])
    adv = opd_advantages(per_token, student, teacher, torch.ones(1, 2), coef=2.0)
    # gap = (-1 - -2, -1 - 0) = (1, -1); A_t = (0.5 - 2*1, -0.5 - 2*(-1)) = (-1.5, 1.5)
    torch.testing.assert_close(adv, torch.tensor([[-1.5, 1.5]]))
    assert not adv.requires_grad
    with pytest.raises(ValueError, match=r"expected \[B\] = \[1\] or \[B, T\]"):
        opd_advantages(torch.zeros(3), student.detach(), teacher, torch.ones(1, 2), coef=1.0)


def test_advantages_by_group_matches_group_advantages_and_handles_uneven_groups() -> None:
    rewards = [1.0, 0.0, 0.5, 0.5]
    even = advantages_by_group(rewards, [1, 1, 2, 2], True)
    assert even == pytest.approx(group_advantages(torch.tensor(rewards), 2, True).tolist())
    # Group 7 has three samples (mean 1.0), group 8 one (its own mean: advantage 0).
    uneven = advantages_by_group([0.0, 1.0, 2.0, 5.0], [7, 7, 7, 8], False)
    assert uneven == pytest.approx([-1.0, 0.0, 1.0, 0.0])
