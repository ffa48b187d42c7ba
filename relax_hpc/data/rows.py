"""Samples <-> transfer-queue rows (named fields of tensors and scalars, no pickling)."""

from __future__ import annotations

from typing import Any

import torch

from relax_hpc.data.sample import Sample

# Fields the trainer needs; the names follow REFERENCE.md's data-bus fields.
TRAIN_FIELDS = ("tokens", "prompt_length", "rollout_log_probs", "loss_mask", "advantages",
                "rewards", "raw_reward", "weight_version", "group_id")
# With routing replay on, the trainer also asks for this field: the engine's routed experts,
# [P + R - 1, layers, top_k] in the narrow integer dtype the engine chose (uint8 up to 256 experts).
ROUTED_EXPERTS_FIELD = "routed_experts"


def sample_to_row(s: Sample) -> dict[str, Any]:
    row = {
        "tokens": torch.tensor(s.prompt_ids + s.response_ids, dtype=torch.int64),
        "prompt_length": len(s.prompt_ids),
        "response_length": len(s.response_ids),
        "rollout_log_probs": torch.tensor(s.rollout_log_probs, dtype=torch.float32),
        "loss_mask": torch.tensor(s.mask(), dtype=torch.int8),
        "advantages": float(s.advantage),
        "rewards": float(s.reward),
        "raw_reward": float(s.raw_reward),
        "weight_version": int(s.weight_version),
        "group_id": int(s.group_id),
        "prompt_index": int(s.prompt_index),
    }
    if s.routed_experts is not None:
        row[ROUTED_EXPERTS_FIELD] = s.routed_experts.contiguous()
    return row


def row_to_sample(row: dict[str, Any]) -> Sample:
    tokens = row["tokens"].tolist()
    p = int(row["prompt_length"])
    return Sample(
        prompt_ids=tokens[:p], response_ids=tokens[p:],
        rollout_log_probs=row["rollout_log_probs"].tolist(),
        weight_version=int(row["weight_version"]), group_id=int(row["group_id"]),
        prompt_index=int(row.get("prompt_index", -1)), reward=float(row["rewards"]),
        raw_reward=float(row["raw_reward"]), advantage=float(row["advantages"]),
        loss_mask=[int(x) for x in row["loss_mask"].tolist()],
        old_log_probs=row["log_probs"].tolist() if "log_probs" in row else None,
        ref_log_probs=row["ref_log_probs"].tolist() if "ref_log_probs" in row else None,
        routed_experts=row.get(ROUTED_EXPERTS_FIELD),
    )
