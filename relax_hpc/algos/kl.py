"""Per-token KL penalty estimators between the policy and a reference model.

All estimators take log-probabilities of the *sampled* tokens (not full
distributions), so they are Monte-Carlo estimates of KL(policy || reference)
from samples drawn by the policy (Schulman's "Approximating KL divergence"):

- ``k1``: ``logp - ref_logp``; unbiased, high variance, can be negative.
- ``k2``: ``0.5 * (logp - ref_logp) ** 2``; biased, low variance, >= 0.
- ``k3``: ``exp(ref_logp - logp) - (ref_logp - logp) - 1``; unbiased, >= 0.
- ``low_var_kl``: ``k3`` computed on a log-ratio clamped to [-20, 20] and then
  clamped to [-10, 10], so one token whose probabilities disagree wildly
  cannot dominate the batch (and ``exp`` cannot overflow to ``inf``).

Used by :func:`relax_hpc.algos.losses.policy_loss` for the ``kl_coef`` term and
by anything that wants to log a KL metric. Pure tensor code; no I/O.
"""

from __future__ import annotations

from typing import Final, Literal

import torch
from torch import Tensor

KlEstimator = Literal["k1", "k2", "k3", "low_var_kl"]

KL_ESTIMATORS: Final[tuple[str, ...]] = ("k1", "k2", "k3", "low_var_kl")

# The clamp bounds of ``low_var_kl``: the log-ratio bound keeps exp() finite in
# float32 (exp(88) overflows), the output bound caps a single token's weight.
_LOW_VAR_LOG_RATIO_LIMIT: Final[float] = 20.0
_LOW_VAR_KL_LIMIT: Final[float] = 10.0


def kl_penalty(logp: Tensor, ref_logp: Tensor, estimator: str) -> Tensor:
    """Return the per-token KL estimate ``[B, T]`` of the policy against the reference.

    ``logp`` and ``ref_logp`` are log-probabilities of the same sampled tokens,
    both ``[B, T]``. Gradients flow into ``logp`` (the reference is treated as a
    constant: it is detached here so a caller cannot train it by accident).
    Padding positions are not masked here; aggregate with a mask afterwards.
    """
    if logp.shape != ref_logp.shape:
        raise ValueError(
            f"kl_penalty: logp has shape {tuple(logp.shape)} but ref_logp has shape "
            f"{tuple(ref_logp.shape)}; both must be the same [B, T] per-token tensor"
        )
    ref = ref_logp.detach()
    if estimator == "k1":
        return logp - ref
    if estimator == "k2":
        return 0.5 * (logp - ref).square()
    if estimator == "k3":
        log_ratio = ref - logp
        return torch.exp(log_ratio) - log_ratio - 1.0
    if estimator == "low_var_kl":
        log_ratio = torch.clamp(ref - logp, -_LOW_VAR_LOG_RATIO_LIMIT, _LOW_VAR_LOG_RATIO_LIMIT)
        k3 = torch.exp(log_ratio) - log_ratio - 1.0
        return torch.clamp(k3, -_LOW_VAR_KL_LIMIT, _LOW_VAR_KL_LIMIT)
    raise ValueError(
        f"unknown KL estimator {estimator!r} ([algorithm] kl_estimator); "
        f"allowed: {', '.join(KL_ESTIMATORS)}"
    )
