"""Samples <-> transfer-queue rows (named fields of tensors and scalars, no pickling)."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from typing import Any

import numpy as np
import torch

from relax_hpc.data.sample import NO_SAMPLE_ID, Sample
from relax_hpc.media.items import MEDIA_ORDER, MediaItem, PromptMedia
from relax_hpc.transfer.columns import ArrayColumn, ColumnRows

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


def samples_to_rows(samples: Sequence[Sample], without: Sequence[str] = ()) -> Sequence[dict[str, Any]]:
    """The rows `sample_to_row` makes, less the fields ``without``, built by column: one array of
    every sample's tokens, one of log-probs, one of loss masks, a list per scalar field
    (`relax_hpc.transfer.columns.ColumnRows`). At 16,384 samples this takes 0.64x the time of
    the one-by-one build, and the rows reach the wire without a per-row pass, in 0.08x the time
    (benchmarks/bench_rows.py).

    Samples that differ in their optional fields (routed experts on some only, or of different
    dtypes; media on some only) are built one by one, as a list of dicts.
    """
    if not samples:
        return []
    if not _alike(samples):
        rows = [sample_to_row(s) for s in samples]
        for row in rows:
            for name in without:
                row.pop(name, None)
        return rows
    prompt_lengths = [len(s.prompt_ids) for s in samples]
    response_lengths = [len(s.response_ids) for s in samples]
    token_lengths = [p + r for p, r in zip(prompt_lengths, response_lengths)]
    tokens = np.fromiter(chain.from_iterable(chain.from_iterable((s.prompt_ids, s.response_ids) for s in samples)),
                         dtype=np.int64, count=sum(token_lengths))
    log_prob_lengths = [len(s.rollout_log_probs) for s in samples]
    log_probs = np.fromiter(chain.from_iterable(s.rollout_log_probs for s in samples), dtype=np.float32,
                            count=sum(log_prob_lengths))
    if all(s.loss_mask is None for s in samples):
        loss_mask = torch.ones(sum(response_lengths), dtype=torch.int8)
        mask_lengths = response_lengths
    else:
        masks = [s.loss_mask if s.loss_mask is not None else [1] * n for s, n in zip(samples, response_lengths)]
        mask_lengths = [len(m) for m in masks]
        loss_mask = torch.from_numpy(np.fromiter(chain.from_iterable(masks), dtype=np.int8, count=sum(mask_lengths)))
    columns: dict[str, Any] = {
        "tokens": ArrayColumn.of_lengths(torch.from_numpy(tokens), token_lengths),
        "prompt_length": prompt_lengths,
        "response_length": response_lengths,
        "rollout_log_probs": ArrayColumn.of_lengths(torch.from_numpy(log_probs), log_prob_lengths),
        "loss_mask": ArrayColumn.of_lengths(loss_mask, mask_lengths),
        "advantages": [float(s.advantage) for s in samples],
        "rewards": [float(s.reward) for s in samples],
        "raw_reward": [float(s.raw_reward) for s in samples],
        "weight_version": [int(s.weight_version) for s in samples],
        "group_id": [int(s.group_id) for s in samples],
        "prompt_index": [int(s.prompt_index) for s in samples],
        "sample_id": [int(s.sample_id) for s in samples],
    }
    if samples[0].routed_experts is not None:
        columns[ROUTED_EXPERTS_FIELD] = ArrayColumn.joined([s.routed_experts for s in samples])  # type: ignore[misc]
    if samples[0].media is not None:
        media = [media_to_fields(s.media) for s in samples]  # type: ignore[arg-type]
        for name in MEDIA_FIELDS:
            columns[name] = ArrayColumn.joined([m[name] for m in media])
    for name in without:
        columns.pop(name, None)
    return ColumnRows(len(samples), columns)


def _alike(samples: Sequence[Sample]) -> bool:
    """Whether every sample's row has the same fields of the same dtypes."""
    experts = {None if s.routed_experts is None else s.routed_experts.dtype for s in samples}
    return len(experts) == 1 and len({s.media is None for s in samples}) == 1


def row_to_sample(row: dict[str, Any]) -> Sample:
    tokens = row["tokens"].tolist()
    p = int(row["prompt_length"])
    return Sample(
        prompt_ids=tokens[:p], response_ids=tokens[p:],
        rollout_log_probs=row["rollout_log_probs"].tolist(),
        weight_version=int(row["weight_version"]), group_id=int(row["group_id"]),
        prompt_index=int(row.get("prompt_index", -1)),
        sample_id=int(row.get("sample_id", NO_SAMPLE_ID)), reward=float(row["rewards"]),
        raw_reward=float(row["raw_reward"]), advantage=_sample_advantage(row["advantages"]),
        loss_mask=[int(x) for x in row["loss_mask"].tolist()],
        old_log_probs=row["log_probs"].tolist() if "log_probs" in row else None,
        ref_log_probs=row["ref_log_probs"].tolist() if "ref_log_probs" in row else None,
        routed_experts=row.get(ROUTED_EXPERTS_FIELD),
        media=media_from_fields(row),
    )


def _sample_advantage(value: Any) -> float:
    """A row's advantage as a sample's one number: per-token ones (the critic's GAE) by their mean."""
    if isinstance(value, torch.Tensor) and value.dim() == 1:
        return float(value.double().mean()) if value.numel() else 0.0
    return float(value)
