"""Types shared by every policy-loss algorithm: settings, inputs, per-token result.

An algorithm is a function ``(LossSettings, LossInputs) -> PolicyTerms`` that
returns the *per-token* policy loss; :func:`relax_hpc.algos.losses.policy_loss`
then applies the shared pieces (TIS weight, aggregation, KL loss, entropy
bonus, statistics). Adding an algorithm means writing one such function in its
own module and adding one line to the registry in ``losses.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Final, Protocol

import torch
from torch import Tensor

# exp(20) ~ 4.9e8: far outside any clip range, yet finite in float32 and
# bfloat16, so a wildly off-policy token cannot turn the loss into inf/NaN.
LOG_RATIO_LIMIT: Final[float] = 20.0


class LossSettings(Protocol):
    """What the policy loss reads of [algorithm]: a `relax_hpc.spec.schema.AlgorithmSpec` is one.

    Tests build one with `AlgorithmSpec(name="gspo", ...)`; the defaults are the spec's."""

    @property
    def name(self) -> str: ...

    @property
    def clip_eps_low(self) -> float: ...

    @property
    def clip_eps_high(self) -> float: ...

    @property
    def kl_coef(self) -> float: ...  # 0 disables the KL loss

    @property
    def kl_estimator(self) -> str: ...

    @property
    def loss_agg(self) -> str: ...

    @property
    def entropy_coef(self) -> float: ...  # 0 disables the entropy bonus

    @property
    def dual_clip_c(self) -> float | None: ...  # None disables dual-clip

    @property
    def tis_cap(self) -> float | None: ...  # None disables truncated importance sampling

    @property
    def sapo_tau_pos(self) -> float: ...

    @property
    def sapo_tau_neg(self) -> float: ...


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


PolicyLossFn = Callable[[LossSettings, LossInputs], PolicyTerms]


def log_ratio(logp: Tensor, old_logp: Tensor) -> Tensor:
    """Return ``logp - old_logp`` clamped to +-LOG_RATIO_LIMIT (the old policy is a constant)."""
    return torch.clamp(logp - old_logp.detach(), -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
