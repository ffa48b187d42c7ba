"""Pack samples into right-padded training tensors.

Positions are shifted for next-token prediction: column t of the per-token tensors holds the
prediction of token t+1 of the sequence, so the response tokens of a sample with a prompt of
length P sit at columns P-1 .. P+R-2.
"""

from __future__ import annotations

from dataclasses import dataclass

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

    def __len__(self) -> int:
        return self.input_ids.size(0)

    def slice(self, start: int, stop: int) -> "TrainBatch":
        return TrainBatch(*(t[start:stop] for t in (
            self.input_ids, self.attention_mask, self.targets, self.loss_mask,
            self.rollout_log_probs, self.advantages,
        )))

    def to(self, device: torch.device) -> "TrainBatch":
        return TrainBatch(*(t.to(device) for t in (
            self.input_ids, self.attention_mask, self.targets, self.loss_mask,
            self.rollout_log_probs, self.advantages,
        )))


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
    return TrainBatch(input_ids, attention, input_ids[:, 1:].clone(), loss_mask, rollout_lp, advantages)
