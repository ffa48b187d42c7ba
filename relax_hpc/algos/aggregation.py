"""Reduce a per-token ``[B, T]`` quantity to one scalar under a 0/1 token mask.

Two modes, chosen by ``[algorithm] loss_agg``:

- ``seq_mean_token_mean`` (default, as in Relax): average over the trained
  tokens of each sequence, then average those B numbers. Every sequence weighs
  the same whatever its length. A fully masked sequence contributes 0 to the
  sum and still counts in the divisor B, so the scale of the loss does not
  depend on how many sequences happened to be masked out (this matches Relax,
  which divides the sum of per-sample means by the number of samples).
- ``token_mean``: sum over all trained tokens of the batch divided by their
  count. Every token weighs the same, so long sequences weigh more (the
  choice of DAPO and Dr.GRPO-style training).

Masked positions are selected away with ``torch.where`` rather than
multiplied by 0, so a NaN or inf sitting in padding (e.g. a -inf log-prob)
cannot leak into the result. An all-masked batch aggregates to 0, not NaN.
"""

from __future__ import annotations

from typing import Final, Literal

import torch
from torch import Tensor

LossAgg = Literal["seq_mean_token_mean", "token_mean"]

LOSS_AGG_MODES: Final[tuple[str, ...]] = ("seq_mean_token_mean", "token_mean")


def aggregate(per_token: Tensor, mask: Tensor, mode: str = "seq_mean_token_mean") -> Tensor:
    """Return the scalar aggregate of ``per_token`` ``[B, T]`` over tokens where ``mask`` is 1.

    ``mask`` is ``[B, T]``, bool or float with values 0/1. See the module
    docstring for the two ``mode`` values.
    """
    if per_token.shape != mask.shape or per_token.dim() != 2:
        raise ValueError(
            f"aggregate: per_token has shape {tuple(per_token.shape)} and mask has shape "
            f"{tuple(mask.shape)}; both must be the same [B, T]"
        )
    keep = mask.to(torch.bool)
    values = torch.where(keep, per_token, torch.zeros_like(per_token))
    if mode == "seq_mean_token_mean":
        tokens_per_seq = keep.sum(dim=-1).clamp_min(1).to(values.dtype)
        seq_means = values.sum(dim=-1) / tokens_per_seq
        # mean over B sequences; B == 0 is a caller bug, not a NaN to propagate.
        return seq_means.sum() / max(per_token.shape[0], 1)
    if mode == "token_mean":
        total_tokens = keep.sum().clamp_min(1).to(values.dtype)
        return values.sum() / total_tokens
    raise ValueError(
        f"unknown loss aggregation {mode!r} ([algorithm] loss_agg); "
        f"allowed: {', '.join(LOSS_AGG_MODES)}"
    )


def masked_token_mean(values: Tensor, mask: Tensor) -> float:
    """Return the token-level mean of ``values`` over ``mask`` as a Python float, for logging."""
    with torch.no_grad():
        return float(aggregate(values.detach(), mask, "token_mean").item())
