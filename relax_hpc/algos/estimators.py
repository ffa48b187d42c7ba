"""Outcome advantage estimators beside group normalisation, and DAPO's overlong shaping.

``[algorithm] advantage`` picks how a step's rewards become advantages (docs/algorithms/):

- ``"group"``: GRPO's (and Dr.GRPO's) group normalisation, `advantages.group_advantages`.
- ``"rloo"``: REINFORCE Leave-One-Out (Ahmadian et al. 2024, arXiv:2402.14740): each sample's
  baseline is the mean reward of the *other* samples of its prompt,
  ``A_i = r_i - (sum_g r - r_i) / (G - 1) = G / (G - 1) * (r_i - mean_g)``.
- ``"reinforce_pp_baseline"``: REINFORCE++-baseline (Hu et al. 2025, arXiv:2501.03262): the
  group mean is subtracted, then the step's values are whitened over its trained tokens.
- ``"reinforce_pp"``: REINFORCE++ on an outcome reward with gamma = 1 (the same paper): each
  token's return is the sample's reward, whitened over the step's trained tokens, no group.

"Whitened over the trained tokens" is the peers' masked whitening (veRL's ``masked_whiten``,
OpenRLHF's batch normalisation): an outcome value repeats on each of a sample's trained tokens, so
the mean and the variance weigh a sample by its count of trained tokens, and the variance has
Bessel's correction over those tokens. Groups are given by group ids, in any order and of any
size (agent sessions export a varying number of samples per prompt). A group of one sample, and a
group of equal rewards, has no baseline to compare against: its centred value is 0 (veRL keeps a
lone sample's raw reward under RLOO; here it carries no signal, as under GRPO).

Everything here is a pure function of tensors and lists; nothing knows about samples or roles.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import torch
from torch import Tensor

from relax_hpc.algos.advantages import advantages_by_group

# The values of [algorithm] advantage (relax_hpc.spec.schema.AdvantageEstimator; a test holds the two equal).
# "gae" is per token, from the critic's values: relax_hpc/algos/gae.py, written by the critic role.
ESTIMATORS: Final[tuple[str, ...]] = ("group", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae")
# Estimators that compare the samples of one prompt, so a group needs two samples or more.
GROUP_ESTIMATORS: Final[tuple[str, ...]] = ("group", "rloo", "reinforce_pp_baseline")
# Estimators whose values are whitened over the step's trained tokens.
WHITENED_ESTIMATORS: Final[tuple[str, ...]] = ("reinforce_pp", "reinforce_pp_baseline")
WHITEN_EPS: Final[float] = 1e-8  # veRL's masked_whiten: (x - mean) * rsqrt(var + 1e-8)


def _members(group_ids: Sequence[int]) -> list[list[int]]:
    by_group: dict[int, list[int]] = {}
    for i, g in enumerate(group_ids):
        by_group.setdefault(int(g), []).append(i)
    return list(by_group.values())


def _check(rewards: Tensor, group_ids: Sequence[int]) -> None:
    if rewards.dim() != 1 or not rewards.is_floating_point():
        raise ValueError(f"rewards must be a 1-D float tensor [B], got shape {tuple(rewards.shape)} "
                         f"and dtype {rewards.dtype}")
    if len(group_ids) != rewards.shape[0]:
        raise ValueError(f"{rewards.shape[0]} rewards but {len(group_ids)} group ids; each sample has one")


def rloo_advantages(rewards: Tensor, group_ids: Sequence[int]) -> Tensor:
    """RLOO: ``r_i`` minus the mean of the other rewards of its group; 0 in a group of one."""
    _check(rewards, group_ids)
    out = torch.zeros_like(rewards)
    with torch.no_grad():
        for idx in _members(group_ids):
            size = len(idx)
            if size < 2:
                continue
            group = rewards[idx].detach()
            out[idx] = (group * size - group.sum()) / (size - 1)  # = r_i - (sum - r_i) / (G - 1)
    return out


def group_centred(rewards: Tensor, group_ids: Sequence[int]) -> Tensor:
    """``r_i - mean_g``: REINFORCE++-baseline's first half; 0 in a group of one."""
    _check(rewards, group_ids)
    out = torch.zeros_like(rewards)
    with torch.no_grad():
        for idx in _members(group_ids):
            group = rewards[idx].detach()
            out[idx] = group - group.mean()
    return out


def whiten_over_tokens(values: Tensor, token_counts: Tensor, eps: float = WHITEN_EPS) -> Tensor:
    """``(v - mean) / sqrt(var + eps)`` where each sample's value counts once per trained token:
    ``mean = sum(n_i v_i) / N`` and ``var = sum(n_i (v_i - mean)^2) / (N - 1)``, ``N = sum(n_i)``.
    A sample with no trained token (``n_i = 0``) does not count and gets 0; so does every sample of
    a step with fewer than two trained tokens (nothing to whiten against)."""
    if values.shape != token_counts.shape or values.dim() != 1:
        raise ValueError(f"values {tuple(values.shape)} and token_counts {tuple(token_counts.shape)} must be "
                         "one [B] shape")
    with torch.no_grad():
        # In float64: 1 / sqrt(eps) is 1e4, so float32's rounding of a mean of equal values
        # (1e-8) would come out as advantages of 1e-4 where there is no signal at all.
        counts, wide = token_counts.detach().double(), values.detach().double()
        if (counts < 0).any():
            raise ValueError("token_counts must be >= 0 (a sample's trained tokens)")
        total = counts.sum()
        if total < 2:
            return torch.zeros_like(values)
        mean = (counts * wide).sum() / total
        var = (counts * (wide - mean) ** 2).sum() / (total - 1)
        out = (wide - mean) * torch.rsqrt(var + eps)
        return torch.where(counts > 0, out, torch.zeros_like(out)).to(values.dtype)


def outcome_advantages(estimator: str, rewards: Tensor, group_ids: Sequence[int], token_counts: Tensor,
                       normalize_std: bool = True) -> Tensor:
    """One value per sample for a step: `estimator` over its rewards (``[B]``), the samples' group
    ids and their trained-token counts (``[B]``, used by the whitened estimators)."""
    if estimator == "group":
        return torch.tensor(advantages_by_group(rewards.tolist(), list(group_ids), normalize_std),
                            dtype=rewards.dtype)
    if estimator == "rloo":
        return rloo_advantages(rewards, group_ids)
    if estimator == "reinforce_pp_baseline":
        return whiten_over_tokens(group_centred(rewards, group_ids), token_counts)
    if estimator == "reinforce_pp":
        _check(rewards, group_ids)
        return whiten_over_tokens(rewards, token_counts)
    if estimator == "gae":
        raise ValueError('[algorithm] advantage = "gae" is per token, from the critic\'s values: the critic role '
                         "computes it (relax_hpc/algos/gae.py), not the rollout or Advantages role")
    raise ValueError(f"[algorithm] advantage = {estimator!r} is not one of {', '.join(ESTIMATORS)}")


def reinforce_pp_token_advantages(rewards: Tensor, kl: Tensor, mask: Tensor, kl_coef: float,
                                  eps: float = WHITEN_EPS) -> Tensor:
    """REINFORCE++ with the KL in the reward, as its authors use it, per token ``[B, T]``: the token
    reward is ``-kl_coef * kl_t``, plus the sample's outcome reward on its last trained token; the
    return is the sum of the rewards from t on (gamma = 1); the returns are whitened over every
    trained token of the batch (`mask` = 1) and 0 elsewhere. ``kl`` is a per-token estimate of
    KL(policy || reference) on the sampled tokens (e.g. ``logp - ref_logp``)."""
    if kl.shape != mask.shape or kl.dim() != 2 or rewards.shape != kl.shape[:1]:
        raise ValueError(f"rewards [B], kl and mask [B, T] must agree, got {tuple(rewards.shape)}, "
                         f"{tuple(kl.shape)} and {tuple(mask.shape)}")
    with torch.no_grad():
        keep = mask.double()  # float64 throughout, as in whiten_over_tokens
        token_rewards = -kl_coef * kl.detach().double() * keep
        positions = torch.arange(kl.shape[1], device=kl.device).expand_as(keep)
        last = torch.where(keep > 0, positions, torch.full_like(positions, -1)).max(dim=1).values
        rows = torch.nonzero(last >= 0).flatten()
        token_rewards[rows, last[rows]] += rewards.detach().double()[rows]
        returns = token_rewards.flip(-1).cumsum(-1).flip(-1) * keep
        total = keep.sum()
        if total < 2:
            return torch.zeros_like(kl)
        mean = returns.sum() / total
        var = (((returns - mean) * keep) ** 2).sum() / (total - 1)
        return ((returns - mean) * torch.rsqrt(var + eps) * keep).to(kl.dtype)


def overlong_penalty(response_lengths: Sequence[int], max_new_tokens: int, buffer_len: int,
                     factor: float) -> list[float]:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476): 0 up to
    ``max_new_tokens - buffer_len`` tokens, then falling linearly to ``-factor`` at
    ``max_new_tokens``: ``min(0, -(L - (max_new_tokens - buffer_len)) / buffer_len * factor)``."""
    if buffer_len < 1 or buffer_len > max_new_tokens:
        raise ValueError(f"overlong_buffer_len must be in [1, max_new_tokens = {max_new_tokens}], got {buffer_len}")
    expected = max_new_tokens - buffer_len
    return [min(0.0, -(length - expected) / buffer_len * factor) for length in response_lengths]
