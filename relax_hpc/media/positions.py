"""Multimodal rotary positions (M-RoPE), computed one way for the engine and the trainer.

Qwen VL / Omni models place media tokens on a 3-D (time, height, width) grid and continue text
after a medium at the grid's extent + 1, so a token's position is not its index. The models can
compute this themselves, but each family has a different trigger (Qwen2.5-VL silently falls back
to 1-D positions without `mm_token_type_ids`, the Omni thinkers only compute it with an
attention mask) and they cache `rope_deltas` on the module. So relax-hpc always passes explicit
(3, B, L) positions from this function, which calls the model's own `get_rope_index`: the engine
for the prompt, the trainer for prompt + response, and both get the same numbers.
"""

from __future__ import annotations

import inspect
from typing import Any, Sequence

import torch

from relax_hpc.media.items import PromptMedia
from relax_hpc.media.processor import BatchMedia, MediaProcessor


def rope_owner(model: torch.nn.Module) -> Any:
    """The module whose `get_rope_index` computes the positions (VL: the inner model)."""
    for candidate in (model, getattr(model, "model", None)):
        if candidate is not None and hasattr(candidate, "get_rope_index"):
            return candidate
    raise TypeError(f"{type(model).__name__} has no get_rope_index; it is not a Qwen VL / Omni model")


def mrope_positions(
    model: torch.nn.Module,
    processor: MediaProcessor,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    media: BatchMedia,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(position_ids (3, B, L), deltas (B, 1)) for `input_ids` whose placeholders are expanded.

    Padding (attention_mask 0) may be on either side; padded slots get position 0 (masked anyway).
    """
    owner = rope_owner(model)
    params = inspect.signature(owner.get_rope_index).parameters
    tensors = media.tensors
    kwargs: dict[str, Any] = {
        "image_grid_thw": tensors.get("image_grid_thw"),
        "video_grid_thw": tensors.get("video_grid_thw"),
        "attention_mask": attention_mask,
    }
    if processor.family.rope == "vl":
        kwargs["mm_token_type_ids"] = processor.mm_token_type_ids(input_ids)
        if "second_per_grid_ts" in params:
            kwargs["second_per_grid_ts"] = tensors.get("second_per_grid_ts")
    else:
        mask = tensors.get("feature_attention_mask")
        kwargs["audio_seqlens"] = mask.sum(-1) if mask is not None else None
        kwargs["use_audio_in_video"] = False
        kwargs["second_per_grids"] = tensors.get("video_second_per_grid")
    with torch.no_grad():
        positions, deltas = owner.get_rope_index(input_ids, **kwargs)
    return positions.to(torch.long), deltas.reshape(-1, 1).to(torch.long)


def forward_kwargs(
    model: torch.nn.Module,
    processor: MediaProcessor,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    media: BatchMedia,
) -> dict[str, Any]:
    """Everything but input_ids / attention_mask that a multimodal forward() needs."""
    positions, _ = mrope_positions(model, processor, input_ids, attention_mask, media)
    kwargs: dict[str, Any] = {"position_ids": positions, **media.kwargs()}
    if processor.family.rope == "vl":
        kwargs["mm_token_type_ids"] = processor.mm_token_type_ids(input_ids)
    return kwargs


def rows_forward_kwargs(
    model: torch.nn.Module,
    processor: MediaProcessor,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    rows: Sequence[PromptMedia | None] | None,
) -> dict[str, Any]:
    """`forward_kwargs` for a batch whose rows carry `rows` (None: no row has media), built on the
    CPU and moved to `input_ids`' device: what the engine, the trainer and the forward roles pass."""
    rows = rows if rows is not None else (None,) * input_ids.shape[0]
    kwargs = forward_kwargs(model, processor, input_ids.cpu(), attention_mask.cpu(), processor.batch_media(rows))
    return {k: v.to(input_ids.device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
