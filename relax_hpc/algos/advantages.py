"""Advantage estimators: group-relative (GRPO / Dr.GRPO) and on-policy distillation.

Called by the Advantages role on a finished rollout batch. Inputs are plain
tensors; nothing here knows about samples, queues or models.

Group layout: the B responses of a batch come in consecutive blocks of
``group_size`` (= ``n_samples_per_prompt``), one block per prompt, which is the
order the rollout role puts them on the transfer queue.

Standard deviation: the *sample* std (Bessel's correction, ``correction=1``,
divisor G - 1) is used deliberately. It is what Relax (``tensor.std()``), veRL
and TRL use, so advantages, and therefore learning rates and clip ranges tuned
there, carry over unchanged. For G = 2 and rewards (1, 0) it gives +-0.7071
where the population std would give +-1.0.
"""

from __future__ import annotations

from typing import Final

import torch
from torch import Tensor

# Algorithms whose advantage is the group-centred reward without the std
# division (Dr.GRPO: dividing by the std up-weights prompts that are almost
# always solved or almost always failed, a difficulty bias).
_ALGORITHMS_WITHOUT_STD: Final[frozenset[str]] = frozenset({"dr_grpo"})

DEFAULT_STD_EPS: Final[float] = 1e-6


def normalizes_std(algorithm: str) -> bool:
    """Return whether ``[algorithm] name`` divides group advantages by the group std."""
    return algorithm not in _ALGORITHMS_WITHOUT_STD


def group_advantages(
    rewards: Tensor,
    group_size: int,
    normalize_std: bool = True,
    eps: float = DEFAULT_STD_EPS,
) -> Tensor:
    """Return per-sequence advantages ``[B]``: ``(r - mean_g) / (std_g + eps)``.

    ``rewards`` is ``[B]`` with ``B`` a multiple of ``group_size``. With
    ``normalize_std=False`` (Dr.GRPO) the result is ``r - mean_g``. A group of
    equal rewards gives exactly 0 for each member (never NaN), and so does a
    group of size 1 (its only member is its own mean). The result has the
    dtype of ``rewards`` (use a float dtype) and carries no gradient.
    """
    if rewards.dim() != 1:
        raise ValueError(
            f"group_advantages: rewards must be a 1-D [B] tensor, got shape {tuple(rewards.shape)}"
        )
    if group_size < 1:
        raise ValueError(
            f"group_advantages: group_size must be >= 1 (n_samples_per_prompt), got {group_size}"
        )
    if rewards.shape[0] % group_size != 0:
        raise ValueError(
            f"group_advantages: batch of {rewards.shape[0]} rewards is not a whole number of "
            f"groups of {group_size}; the rollout must deliver complete groups "
            f"(n_samples_per_prompt = {group_size})"
        )
    if not rewards.is_floating_point():
        raise ValueError(
            f"group_advantages: rewards must be a float tensor, got dtype {rewards.dtype}"
        )
    with torch.no_grad():
        grouped = rewards.detach().reshape(-1, group_size)
        centered = grouped - grouped.mean(dim=-1, keepdim=True)
        if normalize_std and group_size > 1:
            std = grouped.std(dim=-1, correction=1, keepdim=True)
            centered = centered / (std + eps)
        return centered.reshape(-1)


def advantages_by_group(rewards: list[float], group_ids: list[int], normalize_std: bool) -> list[float]:
    """Group-normalised advantages where a group is the samples sharing a group id, in any order
    and of any size (agent sessions export a varying number of samples); each group is computed
    exactly as by `group_advantages`, so the values equal it for consecutive equal-size groups."""
    members: dict[int, list[int]] = {}
    for i, g in enumerate(group_ids):
        members.setdefault(g, []).append(i)
    out = [0.0] * len(rewards)
    for idx in members.values():
        adv = group_advantages(torch.tensor([rewards[i] for i in idx], dtype=torch.float32),
                               len(idx), normalize_std)
        for i, a in zip(idx, adv.tolist()):
            out[i] = a
    return out


def opd_advantages(
    advantages: Tensor,
    student_logp: Tensor,
    teacher_logp: Tensor,
    mask: Tensor,
    coef: float,
) -> Tensor:
    """Return on-policy-distillation advantages ``[B, T]``: ``A_t - coef * (logp_student_t - logp_teacher_t)``.

    ``advantages`` is ``[B]`` (one value per sequence, broadcast to its tokens)
    or ``[B, T]``; ``student_logp`` and ``teacher_logp`` are the log-probs of the
    sampled tokens under the student (the policy being trained) and the teacher.
    The distillation term is a reverse-KL reward: tokens the teacher finds more
    likely than the student get a higher advantage. Positions where ``mask`` is
    0 are set to 0. Advantages are constants for the loss, so the result is
    detached.
    """
    if student_logp.shape != teacher_logp.shape or student_logp.shape != mask.shape:
        raise ValueError(
            "opd_advantages: student_logp, teacher_logp and mask must share one [B, T] shape, got "
            f"{tuple(student_logp.shape)}, {tuple(teacher_logp.shape)}, {tuple(mask.shape)}"
        )
    if student_logp.dim() != 2:
        raise ValueError(
            f"opd_advantages: per-token tensors must be [B, T], got shape {tuple(student_logp.shape)}"
        )
    token_adv = broadcast_advantages(advantages, student_logp)
    with torch.no_grad():
        distill = coef * (student_logp.detach() - teacher_logp.detach())
        combined = token_adv.detach() - distill
        keep = mask.to(torch.bool)
        return torch.where(keep, combined, torch.zeros_like(combined))


def broadcast_advantages(advantages: Tensor, like: Tensor) -> Tensor:
    """Return ``advantages`` as ``[B, T]`` shaped like ``like``: a ``[B]`` value repeats over T."""
    if advantages.dim() == 1 and advantages.shape[0] == like.shape[0]:
        return advantages.unsqueeze(-1).expand_as(like)
    if advantages.shape == like.shape:
        return advantages
    raise ValueError(
        f"advantages have shape {tuple(advantages.shape)}; expected [B] = [{like.shape[0]}] "
        f"or [B, T] = {list(like.shape)} to match the per-token log-probs"
    )
