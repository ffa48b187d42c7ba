"""PPO-clip policy loss: ``grpo``, ``dr_grpo`` and ``opd`` (and the clip shared with ``gspo``).

Per token, with ``r = exp(logp - old_logp)`` and advantage ``A``::

    loss = max(-r * A, -clip(r, 1 - clip_eps_low, 1 + clip_eps_high) * A)

and, when ``dual_clip_c`` is set, for ``A < 0`` only: ``loss = min(loss, -c * A)``,
which bounds how hard one very off-policy negative token can push.

The three algorithms differ outside the loss: Dr.GRPO drops the std division
in the group advantage (see ``advantages.normalizes_std``), OPD adds the
distillation term to the advantages (``advantages.opd_advantages``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from relax_hpc.algos.advantages import broadcast_advantages
from relax_hpc.algos.loss_types import LossSettings, LossInputs, PolicyTerms, log_ratio


def clipped_objective(ratio: Tensor, advantages: Tensor, cfg: LossSettings) -> tuple[Tensor, Tensor]:
    """Return the per-token clipped surrogate loss and a bool mask of where clipping was active.

    ``ratio`` must carry the gradient; ``advantages`` is ``[B, T]``. Where the
    clipped branch wins, ``clamp`` has zero slope outside its range, so those
    tokens contribute no gradient: that is the point of clipping.
    """
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high)
    loss = torch.maximum(unclipped, clipped)
    was_clipped = clipped > unclipped
    if cfg.dual_clip_c is not None:
        cap = -advantages * cfg.dual_clip_c
        dual_active = (advantages < 0) & (cap < loss)
        loss = torch.where(dual_active, cap, loss)
        was_clipped = was_clipped | dual_active
    return loss, was_clipped


def ppo_clip_loss(cfg: LossSettings, inputs: LossInputs) -> PolicyTerms:
    """Token-level PPO-clip with separate low/high eps and optional dual-clip."""
    ratio = torch.exp(log_ratio(inputs.logp, inputs.old_logp))
    advantages = broadcast_advantages(inputs.advantages, inputs.logp).detach()
    loss, was_clipped = clipped_objective(ratio, advantages, cfg)
    return PolicyTerms(loss=loss, ratio=ratio.detach(), clipped=was_clipped)
