"""SAPO policy loss: a smooth, temperature-controlled gate instead of a hard clip.

Per token, with ``r = exp(logp - old_logp)``::

    f(r) = (4 / tau) * sigmoid(tau * (r - 1))
    loss = -f(r) * A,   tau = sapo_tau_pos if A > 0 else sapo_tau_neg

``f'(1) = 1``, so on-policy tokens get the plain policy-gradient weight, and
the weight ``4 * s * (1 - s)`` (``s = sigmoid(tau * (r - 1))``) decays smoothly
as ``r`` moves away from 1 instead of dropping to 0 at a clip edge. A larger
tau decays faster; negative advantages use the slightly larger ``tau_neg``
because off-policy negative updates are the less stable ones. Nothing is hard
clipped, so ``clip_frac`` is always 0 for SAPO.
"""

from __future__ import annotations

import torch

from relax_hpc.algos.advantages import broadcast_advantages
from relax_hpc.algos.loss_types import LossSettings, LossInputs, PolicyTerms, log_ratio


def sapo_loss(cfg: LossSettings, inputs: LossInputs) -> PolicyTerms:
    """Soft-gated policy loss ``-f(r) * A`` with a separate temperature for A > 0 and A <= 0."""
    ratio = torch.exp(log_ratio(inputs.logp, inputs.old_logp))
    advantages = broadcast_advantages(inputs.advantages, inputs.logp).detach()
    tau = torch.where(
        advantages > 0,
        torch.full_like(advantages, cfg.sapo_tau_pos),
        torch.full_like(advantages, cfg.sapo_tau_neg),
    )
    gate = (4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0))
    loss = -gate * advantages
    return PolicyTerms(loss=loss, ratio=ratio.detach(), clipped=torch.zeros_like(ratio, dtype=torch.bool))
