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
    positions: torch.Tensor | None = None,
) -> dict[str, Any]:
    """Everything but input_ids / attention_mask that a multimodal forward() needs; `positions`,
    when given, are the batch's (3, B, L) M-RoPE positions already computed."""
    if positions is None:
        positions, _ = mrope_positions(model, processor, input_ids, attention_mask, media)
    kwargs: dict[str, Any] = {"position_ids": positions, **media.kwargs()}
    if processor.family.rope == "vl":
        kwargs["mm_token_type_ids"] = processor.mm_token_type_ids(input_ids)
    return kwargs


def shared_prefix_positions(
    model: torch.nn.Module,
    processor: MediaProcessor,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    rows: Sequence[PromptMedia | None],
) -> torch.Tensor | None:
    """`mrope_positions`' (3, B, L) positions of a right-padded batch, computed once per group of
    rows that share everything up to their last media markup token (the samples of a GRPO group:
    one prompt, its media, then text); None for a batch with padding on the left.

    After a row's last medium every token is text, whose position goes up by one on each axis, so
    a row's positions are those of its group's longest row, cut at its own length; the padding
    gets what the family's `get_rope_index` gives padding (read from one more padded column).
    """
    lengths = attention_mask.sum(-1)
    width = input_ids.shape[1]
    if not bool((attention_mask == (torch.arange(width)[None, :] < lengths[:, None])).all()):
        return None
    markup = torch.isin(input_ids, torch.tensor(processor.markup_ids or [-1]))
    groups: dict[tuple[tuple[int, ...], PromptMedia | None], list[int]] = {}
    for b in range(input_ids.shape[0]):
        marks = markup[b, : int(lengths[b])].nonzero()
        end = int(marks[-1]) + 1 if len(marks) else 0
        groups.setdefault((tuple(input_ids[b, :end].tolist()), rows[b]), []).append(b)
    longest = [max(members, key=lambda b: int(lengths[b])) for members in groups.values()]
    pad = torch.zeros((len(longest), 1), dtype=input_ids.dtype)
    rep_ids = torch.cat([input_ids[longest], pad], 1)
    rep_mask = torch.cat([attention_mask[longest], pad.to(attention_mask.dtype)], 1)
    rep_positions, _ = mrope_positions(model, processor, rep_ids, rep_mask,
                                       processor.batch_media([rows[b] for b in longest]))
    out = torch.empty((3, *input_ids.shape), dtype=torch.long)
    for r, members in enumerate(groups.values()):
        for b in members:
            n = int(lengths[b])
            out[:, b, :n] = rep_positions[:, r, :n]
            out[:, b, n:] = rep_positions[:, r, width:]  # the padding column's value
    return out


def rows_forward_kwargs(
    model: torch.nn.Module,
    processor: MediaProcessor,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    rows: Sequence[PromptMedia | None] | None,
) -> dict[str, Any]:
    """`forward_kwargs` for a batch whose rows carry `rows` (None: no row has media), built on the
    CPU and moved to `input_ids`' device: what the engine, the trainer and the forward roles pass.
    A right-padded batch's positions are computed once per group of rows sharing their media
    prefix (`shared_prefix_positions`)."""
    rows = rows if rows is not None else (None,) * input_ids.shape[0]
    ids, mask = input_ids.cpu(), attention_mask.cpu()
    positions = shared_prefix_positions(model, processor, ids, mask, rows)
    kwargs = forward_kwargs(model, processor, ids, mask, processor.batch_media(rows), positions)
    return {k: v.to(input_ids.device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
