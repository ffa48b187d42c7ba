"""Types shared by every policy-loss algorithm: config, inputs, per-token result.

An algorithm is a function ``(LossConfig, LossInputs) -> PolicyTerms`` that
returns the *per-token* policy loss; :func:`relax_hpc.algos.losses.policy_loss`
then applies the shared pieces (TIS weight, aggregation, KL loss, entropy
bonus, statistics). Adding an algorithm means writing one such function in its
own module and adding one line to the registry in ``losses.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable, Final

import torch
from torch import Tensor

from relax_hpc.spec.schema import AlgorithmSpec

# exp(20) ~ 4.9e8: far outside any clip range, yet finite in float32 and
# bfloat16, so a wildly off-policy token cannot turn the loss into inf/NaN.
LOG_RATIO_LIMIT: Final[float] = 20.0


@dataclass(frozen=True)
class LossConfig:
    """Knobs of the policy loss; field names match the keys of the TOML ``[algorithm]`` table."""

    name: str = AlgorithmSpec.name
    clip_eps_low: float = AlgorithmSpec.clip_eps_low
    clip_eps_high: float = AlgorithmSpec.clip_eps_high
    kl_coef: float = AlgorithmSpec.kl_coef
    kl_estimator: str = AlgorithmSpec.kl_estimator
    loss_agg: str = AlgorithmSpec.loss_agg
    entropy_coef: float = AlgorithmSpec.entropy_coef
    dual_clip_c: float | None = AlgorithmSpec.dual_clip_c
    tis_cap: float | None = AlgorithmSpec.tis_cap
    sapo_tau_pos: float = AlgorithmSpec.sapo_tau_pos
    sapo_tau_neg: float = AlgorithmSpec.sapo_tau_neg


def loss_config(algorithm: AlgorithmSpec) -> LossConfig:
    """The loss knobs of an `[algorithm]` table (each field is the key of the same name)."""
    return LossConfig(**{f.name: getattr(algorithm, f.name) for f in fields(LossConfig)})


@dataclass
class LossInputs:
    """One micro-batch of B right-padded responses with T positions each."""

    logp: Tensor  # [B, T] current policy log-probs of the sampled tokens (requires grad)
    old_logp: Tensor  # [B, T] log-probs under the policy that generated the batch / old policy
    advantages: Tensor  # [B] (one value per sequence) or [B, T] (per token)
    mask: Tensor  # [B, T] 1 where the token is trained, 0 for prompt/padding/observation
    ref_logp: Tensor | None = None  # [B, T] reference-model log-probs, for the KL loss
    rollout_logp: Tensor | None = None  # [B, T] engine log-probs, for truncated importance sampling
    entropy: Tensor | None = None  # [B, T] per-token entropy of the policy, for the entropy bonus


@dataclass
class PolicyTerms:
    """What an algorithm returns: the per-token loss and what the statistics need."""

    loss: Tensor  # [B, T] per-token policy loss, differentiable w.r.t. inputs.logp
    ratio: Tensor  # [B, T] importance ratio actually used (detached), for "ratio_mean"
    clipped: Tensor  # [B, T] bool, True where clipping cut the gradient, for "clip_frac"


PolicyLossFn = Callable[[LossConfig, LossInputs], PolicyTerms]


def log_ratio(logp: Tensor, old_logp: Tensor) -> Tensor:
    """Return ``logp - old_logp`` clamped to +-LOG_RATIO_LIMIT (the old policy is a constant)."""
    return torch.clamp(logp - old_logp.detach(), -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
