"""Hand-worked checks of the terms policy_loss adds to every algorithm: TIS, KL loss, entropy
bonus, input masking, config validation and the registry."""

from __future__ import annotations

import math
import typing

import pytest
import torch

from relax_hpc.algos import losses
from relax_hpc.algos.advantages import opd_advantages
from relax_hpc.algos.loss_types import LossInputs, LossSettings, PolicyTerms
from relax_hpc.algos.losses import available_losses, get_policy_loss, loss_config_problems, policy_loss
from relax_hpc.spec.schema import AlgorithmSpec


def on_policy(n_tokens: int, advantage: float) -> LossInputs:
    """ratio 1 everywhere (logp = old_logp = 0), one sequence."""
    return LossInputs(
        logp=torch.zeros(1, n_tokens, requires_grad=True),
        old_logp=torch.zeros(1, n_tokens),
        advantages=torch.tensor([advantage]),
        mask=torch.ones(1, n_tokens),
    )


def test_tis_weight_is_clamped_and_multiplies_per_token_loss() -> None:
    inputs = on_policy(3, 1.0)
    inputs.rollout_logp = torch.tensor([[-1.0, 0.5, -0.2]])
    loss, stats = policy_loss(AlgorithmSpec(tis_cap=2.0), inputs)
    # w = exp(old - rollout) = (exp(1) = 2.718282 -> capped 2.0, exp(-0.5) = 0.606531, exp(0.2) = 1.221403)
    # per-token loss at r = 1, A = 1 is -1 -> weighted (-2.0, -0.606531, -1.221403); mean = -1.275978
    assert loss.item() == pytest.approx(-1.275978, abs=1e-6)
    assert stats["tis/weight_mean"] == pytest.approx(1.275978, abs=1e-6)
    assert stats["tis/capped_frac"] == pytest.approx(1 / 3)
    # the weight is a constant: grad = -A * r * w / 3 = (-0.666667, -0.202177, -0.407134)
    loss.backward()
    assert inputs.logp.grad is not None
    torch.testing.assert_close(inputs.logp.grad, torch.tensor([[-0.666667, -0.202177, -0.407134]]), atol=1e-6, rtol=0)


def test_tis_without_rollout_logp_says_what_to_do() -> None:
    with pytest.raises(ValueError, match=r"tis_cap = 2.0 needs the rollout engine's log-probs.*rollout_logp is None"):
        policy_loss(AlgorithmSpec(tis_cap=2.0), on_policy(2, 1.0))


def test_entropy_bonus_is_subtracted_so_descent_raises_entropy() -> None:
    inputs = on_policy(2, 0.0)  # A = 0 -> policy term 0
    entropy = torch.tensor([[1.0, 2.0]], requires_grad=True)
    inputs.entropy = entropy
    loss, stats = policy_loss(AlgorithmSpec(entropy_coef=0.1), inputs)
    # total = 0 - 0.1 * mean(1, 2) = -0.15
    assert loss.item() == pytest.approx(-0.15)
    assert stats["entropy"] == pytest.approx(1.5)
    loss.backward()
    # d total / d entropy_t = -0.1 / 2 = -0.05 < 0: a gradient step increases entropy
    assert entropy.grad is not None
    torch.testing.assert_close(entropy.grad, torch.tensor([[-0.05, -0.05]]))


def test_entropy_coef_without_entropy_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"entropy_coef = 0.1 needs per-token entropy"):
        policy_loss(AlgorithmSpec(entropy_coef=0.1), on_policy(2, 1.0))


def test_kl_loss_adds_coef_times_aggregated_estimate() -> None:
    logp = torch.tensor([[-1.0, -0.5]], requires_grad=True)
    inputs = LossInputs(logp=logp, old_logp=logp.detach().clone(), advantages=torch.tensor([0.0]),
                        mask=torch.ones(1, 2), ref_logp=torch.tensor([[-0.5, -1.0]]))
    loss, stats = policy_loss(AlgorithmSpec(kl_coef=0.5, kl_estimator="k3"), inputs)
    # k3 per token (see test_kl): (0.148721, 0.106531); mean = 0.127626; total = 0.5 * 0.127626 = 0.063813
    assert stats["loss/kl"] == pytest.approx(0.127626, abs=1e-6)
    assert loss.item() == pytest.approx(0.063813, abs=1e-6)
    # d k3/d logp = 1 - exp(ref - logp): (1 - 1.648721, 1 - 0.606531) = (-0.648721, 0.393469)
    # times 0.5 (coef) / 2 (tokens) -> (-0.162180, 0.098367)
    loss.backward()
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.162180, 0.098367]]), atol=1e-6, rtol=0)


def test_kl_is_reported_but_not_added_when_coef_is_zero() -> None:
    inputs = on_policy(2, 0.0)
    inputs.ref_logp = torch.tensor([[-1.0, -1.0]])
    loss, stats = policy_loss(AlgorithmSpec(kl_estimator="k1"), inputs)
    assert stats["loss/kl"] == pytest.approx(1.0)  # k1 = 0 - (-1) = 1 per token
    assert loss.item() == 0.0  # A = 0 and kl_coef = 0


def test_kl_loss_requires_ref_logp() -> None:
    with pytest.raises(ValueError, match=r"kl_coef = 0.1 needs reference log-probs.*ref_logp is None.*kl_coef = 0"):
        policy_loss(AlgorithmSpec(kl_coef=0.1), on_policy(2, 1.0))


def test_unknown_algorithm_lists_available_names() -> None:
    assert available_losses() == ["dr_grpo", "grpo", "gspo", "opd", "sapo"]
    with pytest.raises(ValueError, match=r"algorithm.name = 'ppo2': must be one of dr_grpo, grpo, gspo, opd, sapo"):
        policy_loss(AlgorithmSpec(name="ppo2"), on_policy(1, 1.0))
    with pytest.raises(ValueError, match=r"unknown policy loss 'ppo2'.*available: dr_grpo, grpo, gspo, opd, sapo"):
        get_policy_loss("ppo2")


def test_config_problems_are_reported_all_at_once() -> None:
    cfg = AlgorithmSpec(clip_eps_low=1.5, kl_estimator="k9", loss_agg="sum", dual_clip_c=0.5, tis_cap=0.0,
                     sapo_tau_neg=-1.0, kl_coef=-1.0)
    keys = [problem.split(" = ")[0] for problem in loss_config_problems(cfg)]
    assert keys == ["algorithm.clip_eps_low", "algorithm.kl_coef", "algorithm.kl_estimator", "algorithm.loss_agg",
                    "algorithm.dual_clip_c", "algorithm.tis_cap", "algorithm.sapo_tau_neg"]
    assert loss_config_problems(AlgorithmSpec()) == []


def test_the_loss_reads_its_knobs_from_the_algorithm_table() -> None:
    # LossSettings is a view of [algorithm], not a copy: each knob it reads is an AlgorithmSpec
    # field of the same type (a Literal of strings reads as str), so the trainer hands the loss its
    # own table and a renamed or retyped key fails here.
    read = {name: typing.get_type_hints(member.fget)["return"]
            for name, member in vars(LossSettings).items() if isinstance(member, property)}
    assert set(read) == {"name", "clip_eps_low", "clip_eps_high", "kl_coef", "kl_estimator", "loss_agg",
                         "entropy_coef", "dual_clip_c", "tis_cap", "sapo_tau_pos", "sapo_tau_neg"}
    table = typing.get_type_hints(AlgorithmSpec)
    for name, hint in read.items():
        spec_hint = table[name]
        literal_of_str = typing.get_origin(spec_hint) is typing.Literal and all(
            isinstance(v, str) for v in typing.get_args(spec_hint))
        assert spec_hint == hint or (hint is str and literal_of_str), (name, spec_hint, hint)


def test_registering_a_new_algorithm_is_one_dict_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    def reinforce(cfg: LossSettings, inputs: LossInputs) -> PolicyTerms:
        ratio = torch.ones_like(inputs.logp)
        adv = inputs.advantages.unsqueeze(-1)
        return PolicyTerms(loss=-adv * inputs.logp, ratio=ratio, clipped=torch.zeros_like(ratio, dtype=torch.bool))

    monkeypatch.setitem(losses.POLICY_LOSSES, "reinforce", reinforce)
    inputs = on_policy(2, 3.0)
    loss, _ = policy_loss(AlgorithmSpec(name="reinforce"), inputs)
    loss.backward()
    # loss = -A * logp; d/dlogp_t = -3 / 2 tokens = -1.5
    assert inputs.logp.grad is not None
    torch.testing.assert_close(inputs.logp.grad, torch.tensor([[-1.5, -1.5]]))


def test_opd_trains_on_distillation_advantages() -> None:
    student = torch.tensor([[-1.0, -2.0]])
    adv = opd_advantages(torch.tensor([1.0]), student, torch.tensor([[-0.5, -2.5]]), torch.ones(1, 2), coef=0.5)
    # A_t = 1 - 0.5 * (-0.5, 0.5) = (1.25, 0.75); on-policy r = 1 -> loss_t = -A_t; mean = -1.0
    logp = student.clone().requires_grad_(True)
    inputs = LossInputs(logp=logp, old_logp=student, advantages=adv, mask=torch.ones(1, 2))
    loss, _ = policy_loss(AlgorithmSpec(name="opd"), inputs)
    assert loss.item() == pytest.approx(-1.0)
    loss.backward()
    # grad -A_t * r / 2 = (-0.625, -0.375)
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.625, -0.375]]))


@pytest.mark.parametrize("name", ["grpo", "gspo", "sapo"])
def test_inf_logp_in_padding_gives_finite_loss_and_grad(name: str) -> None:
    logp = torch.tensor([[-0.1, -math.inf]], requires_grad=True)
    inputs = LossInputs(logp=logp, old_logp=torch.tensor([[0.0, -math.inf]]), advantages=torch.tensor([1.0]),
                        mask=torch.tensor([[1.0, 0.0]]), ref_logp=torch.tensor([[0.0, math.nan]]),
                        rollout_logp=torch.tensor([[0.0, -math.inf]]))
    loss, stats = policy_loss(AlgorithmSpec(name=name, kl_coef=0.1, tis_cap=2.0), inputs)
    assert math.isfinite(loss.item())
    assert all(math.isfinite(value) for value in stats.values())
    loss.backward()
    assert logp.grad is not None
    assert torch.isfinite(logp.grad).all() and logp.grad[0, 1] == 0.0


def test_shape_mismatch_names_the_field() -> None:
    inputs = on_policy(3, 1.0)
    inputs.old_logp = torch.zeros(1, 2)
    with pytest.raises(ValueError, match=r"LossInputs.old_logp has shape \(1, 2\); it must match logp's"):
        policy_loss(AlgorithmSpec(), inputs)


def test_step_denominator_scales_the_aggregates_but_not_the_token_means() -> None:
    inputs = on_policy(3, 1.0)  # per-token policy loss -A * ratio = -1
    inputs.entropy = torch.tensor([[1.0, 2.0, 3.0]])
    cfg = AlgorithmSpec(loss_agg="token_mean", entropy_coef=0.1)
    loss, stats = policy_loss(cfg, inputs, denominator=6.0)
    # a micro-batch of 3 tokens out of a step of 6: policy (-1 - 1 - 1) / 6 = -0.5,
    # entropy (1 + 2 + 3) / 6 = 1.0, total = -0.5 - 0.1 * 1.0 = -0.6
    assert loss.item() == pytest.approx(-0.6)
    assert stats["loss/policy"] == pytest.approx(-0.5)
    assert stats["entropy"] == pytest.approx(1.0)
    assert stats["loss/total"] == pytest.approx(-0.6)
    # token means over this micro-batch's own 3 tokens: ratio 1, nothing clipped
    assert stats["ratio_mean"] == pytest.approx(1.0)
    assert stats["clip_frac"] == 0.0
    assert set(losses.STEP_SUM_STATS) == {"loss/policy", "loss/kl", "entropy", "loss/total"}
    loss.backward()
    # d total / d logp_t = -A * ratio / 6 = -1/6 on each token
    assert inputs.logp.grad is not None
    torch.testing.assert_close(inputs.logp.grad, torch.full((1, 3), -1 / 6))
