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

Gradient accumulation and data parallelism: the loss of an optimizer step must
be the aggregate over the *whole* step's batch, not a mean of per-micro-batch
means. Both modes are ``numerator / denominator`` where the numerator adds up
over micro-batches and ranks (sum of trained-token values, or sum of per-sequence
token means) and the denominator is a count (trained tokens, or sequences). A
caller that splits a step passes the step's global count as ``denominator``
(see :func:`loss_denominator`); the sum of the micro-batch aggregates is then
exactly the whole-batch aggregate, and so is the sum of their gradients.

Masked positions are selected away with ``torch.where`` rather than
multiplied by 0, so a NaN or inf sitting in padding (e.g. a -inf log-prob)
cannot leak into the result. An all-masked batch aggregates to 0, not NaN.
"""

from __future__ import annotations

import math
from typing import Final, Literal

import torch
from torch import Tensor

LossAgg = Literal["seq_mean_token_mean", "token_mean"]

LOSS_AGG_MODES: Final[tuple[str, ...]] = ("seq_mean_token_mean", "token_mean")


def aggregate(
    per_token: Tensor, mask: Tensor, mode: str = "seq_mean_token_mean", denominator: float | None = None
) -> Tensor:
    """Return the scalar aggregate of ``per_token`` ``[B, T]`` over tokens where ``mask`` is 1.

    ``mask`` is ``[B, T]``, bool or float with values 0/1. See the module
    docstring for the two ``mode`` values. ``denominator`` replaces this batch's
    own count (its trained tokens for ``token_mean``, its B sequences for
    ``seq_mean_token_mean``): pass the count of the whole optimizer step, over
    all micro-batches and ranks, so that the micro-batch results add up to the
    step's loss. ``None`` divides by this batch's own count.
    """
    if per_token.shape != mask.shape or per_token.dim() != 2:
        raise ValueError(
            f"aggregate: per_token has shape {tuple(per_token.shape)} and mask has shape "
            f"{tuple(mask.shape)}; both must be the same [B, T]"
        )
    _check_mode(mode)
    if denominator is not None and not (math.isfinite(denominator) and denominator > 0):
        raise ValueError(
            f"aggregate: denominator = {denominator!r}; it must be a finite count > 0 "
            "(the step's trained tokens or sequences), or None for this batch's own count"
        )
    keep = mask.to(torch.bool)
    values = torch.where(keep, per_token, 0.0)
    if mode == "seq_mean_token_mean":
        tokens_per_seq = keep.sum(dim=-1).clamp_min(1).to(values.dtype)
        numerator = (values.sum(dim=-1) / tokens_per_seq).sum()
    else:
        numerator = values.sum()
    if denominator is not None:
        return numerator / denominator
    if mode == "seq_mean_token_mean":
        # B == 0 is a caller bug, not a NaN to propagate.
        return numerator / max(per_token.shape[0], 1)
    return numerator / keep.sum().clamp_min(1).to(values.dtype)


def loss_denominator(mask: Tensor, mode: str) -> float:
    """Return the count that ``aggregate`` divides ``mask``'s ``[B, T]`` batch by in ``mode``.

    ``token_mean``: the number of trained tokens; ``seq_mean_token_mean``: B,
    the number of sequences (fully masked ones included). Counts add up, so
    their sum over the micro-batches and ranks of an optimizer step is that
    step's ``denominator``. Not clamped: an all-masked batch counts 0 tokens.
    """
    if mask.dim() != 2:
        raise ValueError(f"loss_denominator: mask has shape {tuple(mask.shape)}; it must be [B, T]")
    _check_mode(mode)
    if mode == "seq_mean_token_mean":
        return float(mask.shape[0])
    return float(mask.to(torch.bool).sum().item())


def _check_mode(mode: str) -> None:
    if mode not in LOSS_AGG_MODES:
        raise ValueError(
            f"unknown loss aggregation {mode!r} ([algorithm] loss_agg); "
            f"allowed: {', '.join(LOSS_AGG_MODES)}"
        )


def masked_token_mean(values: Tensor, mask: Tensor) -> float:
    """Return the token-level mean of ``values`` over ``mask`` as a Python float, for logging."""
    with torch.no_grad():
        return float(aggregate(values.detach(), mask, "token_mean").item())


def masked_token_means(mask: Tensor, values: dict[str, Tensor]) -> dict[str, float]:
    """``masked_token_mean`` of each ``[B, T]`` tensor of ``values`` over one ``mask``, in one pass
    (stacked, masked and summed once: on a small micro-batch a step's statistics cost ops, not
    elements)."""
    with torch.no_grad():
        for name, tensor in values.items():
            if tensor.shape != mask.shape or tensor.dim() != 2:
                raise ValueError(f"masked_token_means: {name} has shape {tuple(tensor.shape)} and mask has "
                                 f"shape {tuple(mask.shape)}; both must be the same [B, T]")
        dtype = torch.float32
        for tensor in values.values():
            dtype = torch.promote_types(dtype, tensor.dtype)
        keep = mask.to(torch.bool)
        stacked = torch.stack([tensor.detach().to(dtype) for tensor in values.values()])
        sums = torch.where(keep, stacked, 0.0).sum(dim=(1, 2)) / keep.sum().clamp_min(1).to(dtype)
        return dict(zip(values, sums.tolist()))
