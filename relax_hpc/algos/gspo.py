"""GSPO policy loss: one sequence-level importance ratio per response (Qwen's GSPO).

With ``s_i = exp(mean over trained tokens t of (logp_t - old_logp_t))``, the
length-normalised sequence ratio, every token of response i uses ``s_i`` in
the usual clipped objective (``ppo_clip.clipped_objective``), so a response is
clipped as a whole and token-level noise in the ratio averages out. Its clip
range is much narrower than PPO's: set ``clip_eps_low`` / ``clip_eps_high`` to
about 3e-4 / 4e-4.

Form chosen: GSPO-token from the paper. The per-token ratio is
``sg[s_i] * exp(logp_t - sg[logp_t])``: its *value* is ``s_i`` at every token
and its gradient with respect to ``logp_t`` is ``s_i``. With one advantage per
sequence this gives exactly the gradient of the plain sequence form (the
length normalisation comes from the token-mean aggregation), and it also
accepts per-token advantages ``[B, T]`` (e.g. on-policy distillation) and the
per-token TIS weight, which the plain form cannot.
"""

from __future__ import annotations

import torch

from relax_hpc.algos.advantages import broadcast_advantages
from relax_hpc.algos.loss_types import LOG_RATIO_LIMIT, LossSettings, LossInputs, PolicyTerms
from relax_hpc.algos.ppo_clip import clipped_objective


def gspo_loss(cfg: LossSettings, inputs: LossInputs) -> PolicyTerms:
    """GSPO-token: the sequence ratio ``s_i`` applied to every token of response i."""
    keep = inputs.mask.to(torch.bool)
    token_log_ratio = inputs.logp.detach() - inputs.old_logp.detach()
    token_log_ratio = torch.where(keep, token_log_ratio, torch.zeros_like(token_log_ratio))
    tokens_per_seq = keep.sum(dim=-1).clamp_min(1).to(token_log_ratio.dtype)
    seq_log_ratio = torch.clamp(
        token_log_ratio.sum(dim=-1) / tokens_per_seq, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT
    )
    seq_ratio = torch.exp(seq_log_ratio).unsqueeze(-1)  # [B, 1], constant
    # value 1, derivative 1 w.r.t. logp_t: carries the gradient, not the value
    straight_through = torch.exp(inputs.logp - inputs.logp.detach())
    ratio = seq_ratio * straight_through
    advantages = broadcast_advantages(inputs.advantages, inputs.logp).detach()
    loss, was_clipped = clipped_objective(ratio, advantages, cfg)
    return PolicyTerms(loss=loss, ratio=ratio.detach(), clipped=was_clipped)
