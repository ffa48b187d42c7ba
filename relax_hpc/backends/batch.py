"""Pack samples into right-padded training tensors.

Positions are shifted for next-token prediction: column t of the per-token tensors holds the
prediction of token t+1 of the sequence, so the response tokens of a sample with a prompt of
length P sit at columns P-1 .. P+R-2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from relax_hpc.data.sample import Sample


@dataclass
class TrainBatch:
    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    targets: torch.Tensor  # [B, L-1] next tokens
    loss_mask: torch.Tensor  # [B, L-1] 1 on trained response tokens
    rollout_log_probs: torch.Tensor  # [B, L-1]
    advantages: torch.Tensor  # [B]
    old_log_probs: torch.Tensor | None = None  # [B, L-1] from ActorFwd, when that role runs
    ref_log_probs: torch.Tensor | None = None  # [B, L-1] from Reference, when that role runs

    def __len__(self) -> int:
        return self.input_ids.size(0)

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "TrainBatch":
        return TrainBatch(*(None if t is None else fn(t) for t in (
            self.input_ids, self.attention_mask, self.targets, self.loss_mask,
            self.rollout_log_probs, self.advantages, self.old_log_probs, self.ref_log_probs,
        )))

    def slice(self, start: int, stop: int) -> "TrainBatch":
        return self._map(lambda t: t[start:stop])

    def to(self, device: torch.device) -> "TrainBatch":
        return self._map(lambda t: t.to(device))


def pack_samples(samples: list[Sample], pad_id: int) -> TrainBatch:
    if not samples:
        raise ValueError("cannot pack an empty list of samples")
    length = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    batch = len(samples)
    input_ids = torch.full((batch, length), pad_id, dtype=torch.long)
    attention = torch.zeros((batch, length), dtype=torch.long)
    loss_mask = torch.zeros((batch, length - 1), dtype=torch.float32)
    rollout_lp = torch.zeros((batch, length - 1), dtype=torch.float32)
    for i, s in enumerate(samples):
        seq = s.prompt_ids + s.response_ids
        p, r = len(s.prompt_ids), len(s.response_ids)
        input_ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        attention[i, : len(seq)] = 1
        if r:
            loss_mask[i, p - 1 : p - 1 + r] = torch.tensor(s.mask(), dtype=torch.float32)
            rollout_lp[i, p - 1 : p - 1 + r] = torch.tensor(s.rollout_log_probs, dtype=torch.float32)
    advantages = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    old_lp = _per_token(samples, length, lambda s: s.old_log_probs)
    ref_lp = _per_token(samples, length, lambda s: s.ref_log_probs)
    return TrainBatch(input_ids, attention, input_ids[:, 1:].clone(), loss_mask, rollout_lp, advantages,
                      old_lp, ref_lp)


def _per_token(samples: list[Sample], length: int,
               get: Callable[[Sample], list[float] | None]) -> torch.Tensor | None:
    """A [B, L-1] tensor of a per-response-token field, or None unless every sample has it."""
    if any(get(s) is None for s in samples):
        return None
    out = torch.zeros((len(samples), length - 1), dtype=torch.float32)
    for i, s in enumerate(samples):
        values = get(s)
        p, r = len(s.prompt_ids), len(s.response_ids)
        if r:
            out[i, p - 1 : p - 1 + r] = torch.tensor(values, dtype=torch.float32)
    return out
