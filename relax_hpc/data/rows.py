"""Samples <-> transfer-queue rows (named fields of tensors and scalars, no pickling)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from relax_hpc.data.sample import NO_SAMPLE_ID, Sample
from relax_hpc.media.items import MEDIA_ORDER, MediaItem, PromptMedia

# Fields the trainer needs; the names follow REFERENCE.md's data-bus fields.
TRAIN_FIELDS = ("tokens", "prompt_length", "rollout_log_probs", "loss_mask", "advantages",
                "rewards", "raw_reward", "weight_version", "group_id")
# What the trainer asks for too when it keeps the trajectory archive: training needs neither the
# dataset row nor the sample's slot in the step (relax_hpc.data.sample.make_sample_id).
ARCHIVE_FIELDS = ("prompt_index", "sample_id")
# With routing replay on, the trainer also asks for this field: the engine's routed experts,
# [P + R - 1, layers, top_k] in the narrow integer dtype the engine chose (uint8 up to 256 experts).
ROUTED_EXPERTS_FIELD = "routed_experts"
# With a multimodal model, every row carries its prompt's canonical media in these fixed fields
# (a get returns only rows that have every field asked for, so a text-only prompt of such a job
# has them too, empty): kinds (0 image, 1 video, 2 audio), shapes padded to 4 axes, rates, and
# the arrays concatenated flat: uint8 pixels of images and videos, float32 audio samples.
MEDIA_FIELDS = ("media_kinds", "media_shapes", "media_rates", "media_u8", "media_f32")


def media_to_fields(media: PromptMedia) -> dict[str, torch.Tensor]:
    items = media.items
    shapes = torch.zeros((len(items), 4), dtype=torch.int64)
    for k, item in enumerate(items):
        shapes[k, : item.data.ndim] = torch.tensor(item.data.shape)
    pixels = [i.data.reshape(-1) for i in items if i.kind != "audio"]
    audio = [i.data.reshape(-1) for i in items if i.kind == "audio"]
    return {
        "media_kinds": torch.tensor([MEDIA_ORDER.index(i.kind) for i in items], dtype=torch.int8),
        "media_shapes": shapes,
        "media_rates": torch.tensor([i.rate for i in items], dtype=torch.float64),
        "media_u8": torch.from_numpy(np.concatenate(pixels) if pixels else np.zeros(0, np.uint8)),
        "media_f32": torch.from_numpy(np.concatenate(audio) if audio else np.zeros(0, np.float32)),
    }


def media_from_fields(row: dict[str, Any]) -> PromptMedia | None:
    """The media a row carries (`media_to_fields`), or None when it has no media fields."""
    if "media_kinds" not in row:
        return None
    pixels = row["media_u8"].numpy() if isinstance(row["media_u8"], torch.Tensor) else np.asarray(row["media_u8"])
    audio = row["media_f32"].numpy() if isinstance(row["media_f32"], torch.Tensor) else np.asarray(row["media_f32"])
    items, at_u8, at_f32 = [], 0, 0
    for code, shape, rate in zip(row["media_kinds"].tolist(), row["media_shapes"].tolist(), row["media_rates"].tolist()):
        kind = MEDIA_ORDER[int(code)]
        dims = tuple(int(d) for d in shape[: {"image": 3, "video": 4, "audio": 1}[kind]])
        size = int(np.prod(dims))
        if kind == "audio":
            data, at_f32 = audio[at_f32 : at_f32 + size].reshape(dims).copy(), at_f32 + size
        else:
            data, at_u8 = pixels[at_u8 : at_u8 + size].reshape(dims).copy(), at_u8 + size
        items.append(MediaItem(kind, data, float(rate)))
    return PromptMedia(tuple(items))


def sample_to_row(s: Sample) -> dict[str, Any]:
    """The queue row of one sample. The lists become tensors through numpy: `torch.tensor` of a
    Python list costs about 4 times as much, and at hundreds of engines one rollout process
    builds every row of a step (docs/benchmarks.md, "Fleet simulation")."""
    tokens = np.array(s.prompt_ids, dtype=np.int64) if not s.response_ids else np.concatenate(
        (np.array(s.prompt_ids, dtype=np.int64), np.array(s.response_ids, dtype=np.int64)))
    loss_mask = (torch.ones(len(s.response_ids), dtype=torch.int8) if s.loss_mask is None
                 else torch.from_numpy(np.array(s.loss_mask, dtype=np.int8)))
    row = {
        "tokens": torch.from_numpy(tokens),
        "prompt_length": len(s.prompt_ids),
        "response_length": len(s.response_ids),
        "rollout_log_probs": torch.from_numpy(np.array(s.rollout_log_probs, dtype=np.float32)),
        "loss_mask": loss_mask,
        "advantages": float(s.advantage),
        "rewards": float(s.reward),
        "raw_reward": float(s.raw_reward),
        "weight_version": int(s.weight_version),
        "group_id": int(s.group_id),
        "prompt_index": int(s.prompt_index),
        "sample_id": int(s.sample_id),
    }
    if s.routed_experts is not None:
        row[ROUTED_EXPERTS_FIELD] = s.routed_experts.contiguous()
    if s.media is not None:
        row.update(media_to_fields(s.media))
    return row


def row_to_sample(row: dict[str, Any]) -> Sample:
    tokens = row["tokens"].tolist()
    p = int(row["prompt_length"])
    return Sample(
        prompt_ids=tokens[:p], response_ids=tokens[p:],
        rollout_log_probs=row["rollout_log_probs"].tolist(),
        weight_version=int(row["weight_version"]), group_id=int(row["group_id"]),
        prompt_index=int(row.get("prompt_index", -1)),
        sample_id=int(row.get("sample_id", NO_SAMPLE_ID)), reward=float(row["rewards"]),
        raw_reward=float(row["raw_reward"]), advantage=float(row["advantages"]),
        loss_mask=[int(x) for x in row["loss_mask"].tolist()],
        old_log_probs=row["log_probs"].tolist() if "log_probs" in row else None,
        ref_log_probs=row["ref_log_probs"].tolist() if "ref_log_probs" in row else None,
        routed_experts=row.get(ROUTED_EXPERTS_FIELD),
        media=media_from_fields(row),
    )
