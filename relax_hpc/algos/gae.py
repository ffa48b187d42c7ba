"""PPO's critic side: token-level GAE, returns, the clipped value loss and the value metrics.

``[algorithm] advantage = "gae"`` (Schulman et al. 2016, arXiv:1506.02438) gives every trained
token its own advantage from a learned value ``V_t`` (the critic role's value pass). The outcome
reward ``r`` sits on the last trained token of each response; every other token's reward is 0.
Walking back over the trained tokens only (a token with mask 0, an observation or padding, is
skipped: it neither takes an advantage nor breaks the chain):

    delta_t = r_t + gamma * V_next - V_t        (V_next = 0 after the last trained token)
    A_t     = delta_t + gamma * lam * A_next
    R_t     = A_t + V_t                          (the critic's target: the lambda-return)

The advantages are then whitened over the step's trained tokens (veRL's ``masked_whiten``:
``(A - mean) * rsqrt(var + 1e-8)``, Bessel-corrected variance); the returns are not. For a
right-padded batch whose padding values are 0 this is veRL's ``compute_gae_advantage_return``.

The critic's loss is PPO's clipped value loss (veRL's ``compute_value_loss``), with ``V_old`` the
values of the value pass and ``V`` the critic's prediction while it trains:

    V_clip = clip(V, V_old - eps, V_old + eps)
    loss_t = 0.5 * max((V - R)^2, (V_clip - R)^2)

aggregated like the policy loss (``loss_agg``). Everything here is a pure function of tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from relax_hpc.algos.aggregation import aggregate
from relax_hpc.algos.estimators import WHITEN_EPS


def _check_token_shapes(**tensors: Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) != 1 or any(len(s) != 2 for s in shapes.values()):
        raise ValueError(f"{', '.join(shapes)} must be one [B, T] shape, got {shapes}")


def terminal_rewards(rewards: Tensor, mask: Tensor) -> Tensor:
    """``[B, T]`` token rewards: each response's outcome reward on its last trained token, 0
    elsewhere (a response with no trained token gets none)."""
    if rewards.dim() != 1 or rewards.shape[0] != mask.shape[0] or mask.dim() != 2:
        raise ValueError(f"rewards [B] and mask [B, T] must agree, got {tuple(rewards.shape)} and {tuple(mask.shape)}")
    keep = mask.to(torch.bool)
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(keep)
    last = torch.where(keep, positions, torch.full_like(positions, -1)).max(dim=1).values
    out = torch.zeros(mask.shape, dtype=torch.float64, device=mask.device)
    rows = torch.nonzero(last >= 0).flatten()
    out[rows, last[rows]] = rewards.detach().double()[rows]
    return out


def gae_advantages_returns(token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float,
                           lam: float) -> tuple[Tensor, Tensor]:
    """Per-token GAE advantages and returns ``[B, T]`` (not whitened; 0 where `mask` is 0).

    `token_rewards` ``[B, T]`` (`terminal_rewards` for an outcome reward), `values` ``[B, T]``
    the critic's ``V_t``; a token with mask 0 is skipped by the recursion (module docstring)."""
    _check_token_shapes(token_rewards=token_rewards, values=values, mask=mask)
    with torch.no_grad():
        keep = mask.to(torch.bool)
        r, v = token_rewards.detach().double(), values.detach().double()
        batch, length = v.shape
        next_value = torch.zeros(batch, dtype=torch.float64, device=v.device)
        next_adv = torch.zeros_like(next_value)
        adv = torch.zeros_like(v)
        for t in reversed(range(length)):
            on = keep[:, t]
            delta = r[:, t] + gamma * next_value - v[:, t]
            a_t = delta + gamma * lam * next_adv
            adv[:, t] = torch.where(on, a_t, torch.zeros_like(a_t))
            next_adv = torch.where(on, a_t, next_adv)
            next_value = torch.where(on, v[:, t], next_value)
        returns = torch.where(keep, adv + v, torch.zeros_like(v))
        return adv.to(values.dtype), returns.to(values.dtype)


def masked_whiten(values: Tensor, mask: Tensor, eps: float = WHITEN_EPS) -> Tensor:
    """``(x - mean) * rsqrt(var + eps)`` over the tokens where `mask` is 1 (variance with Bessel's
    correction), 0 elsewhere; all 0 when fewer than two tokens are trained."""
    _check_token_shapes(values=values, mask=mask)
    with torch.no_grad():
        keep = mask.to(torch.bool)
        wide = values.detach().double()
        total = keep.sum()
        if total < 2:
            return torch.zeros_like(values)
        mean = torch.where(keep, wide, torch.zeros_like(wide)).sum() / total
        centred = torch.where(keep, wide - mean, torch.zeros_like(wide))
        var = (centred ** 2).sum() / (total - 1)
        return (centred * torch.rsqrt(var + eps)).to(values.dtype)


def gae_step(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """A whole step's whitened advantages and its returns ``[B, T]`` from the outcome rewards
    ``[B]`` and the value pass ``[B, T]``: what the critic role writes onto the queued rows."""
    adv, returns = gae_advantages_returns(terminal_rewards(rewards, mask), values, mask, gamma, lam)
    return masked_whiten(adv, mask), returns


def token_moments(values: Tensor, mask: Tensor) -> Tensor:
    """``[count, sum, sum of squares]`` (float64) of `values` over the tokens where `mask` is 1.

    They add up over shards of a step's rows: critic ranks all-reduce them, and
    `whiten_by_moments` with the sums whitens each shard as `masked_whiten` whitens the whole."""
    _check_token_shapes(values=values, mask=mask)
    keep = mask.to(torch.bool)
    wide = values.detach().double()[keep]
    return torch.stack([torch.tensor(float(wide.numel()), dtype=torch.float64), wide.sum(), (wide ** 2).sum()])


def whiten_by_moments(values: Tensor, mask: Tensor, moments: Tensor, eps: float = WHITEN_EPS) -> Tensor:
    """`masked_whiten` with the mean and variance of `moments` (`token_moments`, possibly summed
    over every shard of the step): ``mean = s / n``, ``var = (q - s * mean) / (n - 1)``; all 0 when
    fewer than two tokens are trained in all."""
    _check_token_shapes(values=values, mask=mask)
    count, total, squares = (float(v) for v in moments.double())
    if count < 2:
        return torch.zeros_like(values)
    mean = total / count
    var = max((squares - total * mean) / (count - 1), 0.0)
    keep = mask.to(torch.bool)
    wide = values.detach().double()
    out = torch.where(keep, (wide - mean) / math.sqrt(var + eps), torch.zeros_like(wide))
    return out.to(values.dtype)


def value_moments(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """Sums over the trained tokens (float64) that the critic's metrics need, additive over shards:
    ``[count, sum V, sum R, sum R^2, sum (R - V), sum (R - V)^2]``."""
    _check_token_shapes(values=values, returns=returns, mask=mask)
    keep = mask.to(torch.bool)
    v, r = values.detach().double()[keep], returns.detach().double()[keep]
    e = r - v
    return torch.stack([torch.tensor(float(v.numel()), dtype=torch.float64), v.sum(), r.sum(), (r ** 2).sum(),
                        e.sum(), (e ** 2).sum()])


def value_metrics(moments: Tensor) -> dict[str, float]:
    """`explained_variance`, the mean value and the mean return from `value_moments` (summed over
    every shard of the step): the same numbers as from the whole step at once."""
    count, v_sum, r_sum, r_sq, e_sum, e_sq = (float(x) for x in moments.double())
    if count == 0:
        return {"explained_variance": float("nan"), "values_mean": 0.0, "returns_mean": 0.0}
    means = {"values_mean": v_sum / count, "returns_mean": r_sum / count}
    if count < 2:
        return {"explained_variance": float("nan"), **means}
    var_r = (r_sq - r_sum * r_sum / count) / (count - 1)
    var_e = (e_sq - e_sum * e_sum / count) / (count - 1)
    # Returns that do not vary (all 0 before any reward): NaN, as `explained_variance` says; the
    # one-pass variance of equal values may round to a few ulps of their square instead of 0.
    constant = var_r <= 1e-12 * (r_sq / count)
    return {"explained_variance": float("nan") if constant else 1.0 - var_e / var_r, **means}


@dataclass
class ValueTerms:
    loss: Tensor  # scalar, differentiable w.r.t. the predicted values
    clip_frac: float  # trained tokens where the clipped branch was the larger loss
    value_error: float  # token mean of (V - R)^2 under the prediction, before clipping


def value_loss(pred: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip_eps: float | None,
               loss_agg: str = "token_mean", denominator: float | None = None) -> ValueTerms:
    """PPO's clipped value loss (module docstring); `clip_eps` None: unclipped ``0.5 (V - R)^2``.
    `denominator` as in `aggregate`: the whole optimizer step's count for a micro-batch."""
    _check_token_shapes(pred=pred, old_values=old_values, returns=returns, mask=mask)
    target = returns.detach()
    unclipped = (pred - target) ** 2
    per_token = unclipped
    keep = mask.to(torch.bool)
    clipped_count = 0.0
    if clip_eps is not None:
        old = old_values.detach()
        clipped = (torch.clamp(pred, old - clip_eps, old + clip_eps) - target) ** 2
        per_token = torch.maximum(unclipped, clipped)
        clipped_count = float((keep & (clipped > unclipped)).sum().item())
    trained = max(float(keep.sum().item()), 1.0)
    error = float(torch.where(keep, unclipped.detach(), torch.zeros_like(unclipped)).sum().item()) / trained
    return ValueTerms(0.5 * aggregate(per_token, mask, loss_agg, denominator), clipped_count / trained, error)


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> float:
    """``1 - Var(R - V) / Var(R)`` over the trained tokens: 1 for a perfect critic, 0 for one that
    predicts the mean return, negative for a worse one; NaN when the returns do not vary."""
    _check_token_shapes(values=values, returns=returns, mask=mask)
    keep = mask.to(torch.bool)
    v, r = values.detach().double()[keep], returns.detach().double()[keep]
    if r.numel() < 2:
        return float("nan")
    var_r = r.var(unbiased=True)
    if var_r == 0:
        return float("nan")
    return float(1.0 - (r - v).var(unbiased=True) / var_r)
