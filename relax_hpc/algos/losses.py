"""The policy loss entry point: algorithm registry plus the terms every algorithm shares.

``policy_loss(cfg, inputs)`` looks up ``cfg.name`` in :data:`POLICY_LOSSES`,
gets the per-token policy loss, and then adds, in this order:

1. TIS (``tis_cap`` set): the per-token loss is multiplied by the constant
   ``clamp(exp(old_logp - rollout_logp), 0, tis_cap)``, correcting for the
   rollout engine's probabilities differing from the trainer's.
2. Aggregation over tokens with ``loss_agg`` (see ``aggregation.py``), divided
   by ``denominator`` when the caller gives one (the whole optimizer step's
   token or sequence count, for gradient accumulation and data parallelism).
3. KL loss (``kl_coef > 0``): ``+ kl_coef * aggregate(kl_penalty(logp, ref_logp))``.
4. Entropy bonus (``entropy_coef > 0``): ``- entropy_coef * aggregate(entropy)``.

To add an algorithm: write ``def my_loss(cfg: LossSettings, inputs: LossInputs)
-> PolicyTerms`` in its own module and add one line to ``POLICY_LOSSES``.
The spec layer can call :func:`loss_config_problems` to validate an
``[algorithm]`` table up front.
"""

from __future__ import annotations

import math
from typing import Final

import torch
from torch import Tensor

from relax_hpc.algos.aggregation import LOSS_AGG_MODES, aggregate, loss_denominator, masked_token_means
from relax_hpc.algos.gspo import gspo_loss
from relax_hpc.algos.kl import KL_ESTIMATORS, kl_penalty
from relax_hpc.algos.logprobs import token_logprobs_and_entropy
from relax_hpc.algos.loss_types import (
    LOG_RATIO_LIMIT,
    LossInputs,
    LossSettings,
    PolicyLossFn,
    PolicyTerms,
)
from relax_hpc.algos.ppo_clip import ppo_clip_loss
from relax_hpc.algos.sapo import sapo_loss

__all__ = [
    "POLICY_LOSSES",
    "STEP_SUM_STATS",
    "LossInputs",
    "LossSettings",
    "PolicyTerms",
    "aggregate",
    "available_losses",
    "get_policy_loss",
    "loss_config_problems",
    "loss_denominator",
    "policy_loss",
    "tis_weight",
    "token_logprobs_and_entropy",
]

# name ([algorithm] name) -> per-token policy loss. One line per algorithm.
POLICY_LOSSES: Final[dict[str, PolicyLossFn]] = {
    "grpo": ppo_clip_loss,
    "dr_grpo": ppo_clip_loss,
    "opd": ppo_clip_loss,
    "gspo": gspo_loss,
    "sapo": sapo_loss,
}


# Stats of policy_loss that are aggregates: divided by `denominator` like the loss, so with the
# step's denominator they add up over micro-batches and ranks to the whole step's value. The
# other stats are token means over the micro-batch's own mask.
STEP_SUM_STATS: Final[frozenset[str]] = frozenset({"loss/policy", "loss/kl", "entropy", "loss/total"})


def available_losses() -> list[str]:
    """Return the registered ``[algorithm] name`` values, sorted."""
    return sorted(POLICY_LOSSES)


def get_policy_loss(name: str) -> PolicyLossFn:
    """Return the per-token loss function registered as ``name``."""
    try:
        return POLICY_LOSSES[name]
    except KeyError:
        raise ValueError(
            f"unknown policy loss {name!r} ([algorithm] name); available: {', '.join(available_losses())}"
        ) from None


def loss_config_problems(cfg: LossSettings) -> list[str]:
    """Return every problem with ``cfg`` as ``"algorithm.<key> = <value>: <what is allowed>"``; empty if valid."""
    problems: list[str] = []

    def bad(key: str, value: object, allowed: str) -> None:
        problems.append(f"algorithm.{key} = {value!r}: {allowed}")

    if cfg.name not in POLICY_LOSSES:
        bad("name", cfg.name, f"must be one of {', '.join(available_losses())}")
    if not 0.0 <= cfg.clip_eps_low < 1.0:
        bad("clip_eps_low", cfg.clip_eps_low, "must be in [0, 1) (the ratio floor is 1 - clip_eps_low)")
    if not cfg.clip_eps_high >= 0.0:
        bad("clip_eps_high", cfg.clip_eps_high, "must be >= 0")
    if not (math.isfinite(cfg.kl_coef) and cfg.kl_coef >= 0.0):
        bad("kl_coef", cfg.kl_coef, "must be a finite number >= 0 (0 disables the KL loss)")
    if cfg.kl_estimator not in KL_ESTIMATORS:
        bad("kl_estimator", cfg.kl_estimator, f"must be one of {', '.join(KL_ESTIMATORS)}")
    if cfg.loss_agg not in LOSS_AGG_MODES:
        bad("loss_agg", cfg.loss_agg, f"must be one of {', '.join(LOSS_AGG_MODES)}")
    if not (math.isfinite(cfg.entropy_coef) and cfg.entropy_coef >= 0.0):
        bad("entropy_coef", cfg.entropy_coef, "must be a finite number >= 0 (0 disables the bonus)")
    if cfg.dual_clip_c is not None and not cfg.dual_clip_c > 1.0:
        bad("dual_clip_c", cfg.dual_clip_c, "must be > 1 (typically 3), or left unset to disable dual-clip")
    if cfg.tis_cap is not None and not cfg.tis_cap > 0.0:
        bad("tis_cap", cfg.tis_cap, "must be > 0 (typically 2.0), or left unset to disable TIS")
    for key, tau in (("sapo_tau_pos", cfg.sapo_tau_pos), ("sapo_tau_neg", cfg.sapo_tau_neg)):
        if not (math.isfinite(tau) and tau > 0.0):
            bad(key, tau, "must be a finite number > 0")
    return problems


def tis_weight(old_logp: Tensor, rollout_logp: Tensor, cap: float) -> Tensor:
    """Return the constant per-token TIS weight ``clamp(exp(old_logp - rollout_logp), 0, cap)``."""
    log_w = torch.clamp(old_logp.detach() - rollout_logp.detach(), -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return torch.clamp(torch.exp(log_w), 0.0, cap)


def policy_loss(
    cfg: LossSettings, inputs: LossInputs, denominator: float | None = None
) -> tuple[Tensor, dict[str, float]]:
    """Return ``(scalar loss to backpropagate, stats)`` for one micro-batch.

    ``denominator`` (see ``aggregate``): ``None`` makes the loss this
    micro-batch's own mean; the optimizer step's global count (trained tokens
    for ``token_mean``, sequences for ``seq_mean_token_mean``, summed over all
    micro-batches and ranks) makes it this micro-batch's share of the step's
    loss, so that the shares and their gradients add up to the whole batch's.

    Stats: ``loss/policy`` (aggregated policy term, after TIS), ``loss/kl``
    (aggregated KL estimate, whenever ``ref_logp`` is given; it is added to the
    loss only when ``kl_coef > 0``), ``entropy`` (when given), ``clip_frac`` and
    ``ratio_mean`` (token means over the mask), ``tis/weight_mean`` and
    ``tis/capped_frac`` (when TIS is on), and ``loss/total``. The aggregates
    (:data:`STEP_SUM_STATS`) use ``denominator`` as the loss does; the rest are
    token means over this micro-batch.
    """
    problems = loss_config_problems(cfg)
    if problems:
        raise ValueError("invalid [algorithm] settings:\n  " + "\n  ".join(problems))
    masked = _mask_inputs(cfg, inputs)
    terms = get_policy_loss(cfg.name)(cfg, masked)
    mask = masked.mask
    per_token = terms.loss
    stats: dict[str, float] = {}
    means: dict[str, Tensor] = {}  # token means over the mask, for the stats
    if cfg.tis_cap is not None:
        assert masked.rollout_logp is not None  # checked in _mask_inputs
        weight = tis_weight(masked.old_logp, masked.rollout_logp, cfg.tis_cap)
        per_token = per_token * weight
        means = {"tis/weight_mean": weight, "tis/capped_frac": (weight >= cfg.tis_cap).float()}
    policy_term = aggregate(per_token, mask, cfg.loss_agg, denominator)
    total = policy_term
    stats["loss/policy"] = float(policy_term.detach().item())
    stats.update(masked_token_means(mask, {**means, "clip_frac": terms.clipped.float(), "ratio_mean": terms.ratio}))
    if masked.ref_logp is not None:
        # Without kl_coef the KL is a statistic only: no graph for it.
        logp = masked.logp if cfg.kl_coef > 0.0 else masked.logp.detach()
        kl_per_token = kl_penalty(logp, masked.ref_logp, cfg.kl_estimator)
        kl = aggregate(kl_per_token, mask, cfg.loss_agg, denominator)
        stats["loss/kl"] = float(kl.detach().item())
        if cfg.kl_coef > 0.0:
            total = total + cfg.kl_coef * kl
    if masked.entropy is not None:
        entropy = aggregate(masked.entropy, mask, cfg.loss_agg, denominator)
        stats["entropy"] = float(entropy.detach().item())
        if cfg.entropy_coef > 0.0:
            total = total - cfg.entropy_coef * entropy
    stats["loss/total"] = float(total.detach().item())
    return total, stats


def _mask_inputs(cfg: LossSettings, inputs: LossInputs) -> LossInputs:
    """Check shapes and required inputs, and zero every per-token input outside the mask.

    Zeroing with ``torch.where`` (not multiplication) means a -inf or NaN log-prob
    in padding yields neither a NaN loss nor a NaN gradient.
    """
    shape = inputs.logp.shape
    if inputs.logp.dim() != 2:
        raise ValueError(f"LossInputs.logp must be [B, T], got shape {tuple(shape)}")
    named: dict[str, Tensor | None] = {
        "old_logp": inputs.old_logp,
        "mask": inputs.mask,
        "ref_logp": inputs.ref_logp,
        "rollout_logp": inputs.rollout_logp,
        "entropy": inputs.entropy,
    }
    for field, tensor in named.items():
        if tensor is not None and tensor.shape != shape:
            raise ValueError(
                f"LossInputs.{field} has shape {tuple(tensor.shape)}; it must match logp's [B, T] = {list(shape)}"
            )
    if cfg.kl_coef > 0.0 and inputs.ref_logp is None:
        raise ValueError(
            f"[algorithm] kl_coef = {cfg.kl_coef} needs reference log-probs but LossInputs.ref_logp is None; "
            "enable the reference model (so samples carry ref_log_probs) or set [algorithm] kl_coef = 0"
        )
    if cfg.tis_cap is not None and inputs.rollout_logp is None:
        raise ValueError(
            f"[algorithm] tis_cap = {cfg.tis_cap} needs the rollout engine's log-probs but "
            "LossInputs.rollout_logp is None; pass rollout_log_probs or unset [algorithm] tis_cap"
        )
    if cfg.entropy_coef > 0.0 and inputs.entropy is None:
        raise ValueError(
            f"[algorithm] entropy_coef = {cfg.entropy_coef} needs per-token entropy but LossInputs.entropy "
            "is None; compute it with token_logprobs_and_entropy or set [algorithm] entropy_coef = 0"
        )
    keep = inputs.mask.to(torch.bool)

    def clean(tensor: Tensor | None) -> Tensor | None:
        return None if tensor is None else torch.where(keep, tensor, 0.0)

    advantages = inputs.advantages
    if advantages.shape == shape:
        advantages = torch.where(keep, advantages, 0.0)
    logp = clean(inputs.logp)
    old_logp = clean(inputs.old_logp)
    assert logp is not None and old_logp is not None
    return LossInputs(
        logp=logp,
        old_logp=old_logp,
        advantages=advantages,
        mask=keep,
        ref_logp=clean(inputs.ref_logp),
        rollout_logp=clean(inputs.rollout_logp),
        # Without a bonus the entropy is a statistic only: no graph for it.
        entropy=clean(None if inputs.entropy is None else
                      inputs.entropy if cfg.entropy_coef > 0.0 else inputs.entropy.detach()),
    )
