"""What each supported multimodal model family reads, and how its inputs are named.

One row per Hugging Face `model_type` (the top-level one in config.json). The table is the only
place that knows the differences between the families; the processor, the position function,
the engine and the trainer read it instead of testing class names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

AudioTokens = Callable[[int], int]


def _qwen2_5_omni_audio_tokens(frames: int) -> int:
    # Two stride-2 stages of the Whisper-style encoder (transformers processing_qwen2_5_omni).
    after_conv = (frames - 1) // 2 + 1
    return (after_conv - 2) // 2 + 1


def _qwen3_omni_audio_tokens(frames: int) -> int:
    # The chunked encoder of Qwen3-Omni: 100-frame chunks give 13 tokens each, the rest three
    # stride-2 convolutions (transformers processing_qwen3_omni_moe._get_feat_extract_output_lengths).
    rest = frames % 100
    after = (rest - 1) // 2 + 1
    after = ((after - 1) // 2 + 1 - 1) // 2 + 1
    return after + (frames // 100) * 13


@dataclass(frozen=True)
class Family:
    model_type: str
    kinds: frozenset[str]  # media kinds the model reads
    rope: Literal["vl", "omni"]  # which get_rope_index signature it has
    video_seconds_key: str | None  # forward() kwarg for seconds per temporal grid step, if any
    audio_tokens: AudioTokens | None
    processor_class: str  # the HF processor class a real checkout names
    thinker_config: bool  # a full omni checkpoint: the policy is its thinker
    sglang: bool  # served by the SGLang version the adapter supports
    video_note: str = ""  # why video is refused, when it is


_VISION = frozenset({"image", "video"})
_OMNI = frozenset({"image", "video", "audio"})

FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family("qwen2_5_vl", _VISION, "vl", "second_per_grid_ts", None, "Qwen2_5_VLProcessor", False, True),
        Family(
            "qwen3_vl", frozenset({"image"}), "vl", None, None, "Qwen3VLProcessor", False, True,
            video_note="Qwen3-VL video needs per-frame timestamp text, which relax-hpc does not build yet; "
            "use images, or a Qwen2.5-VL / Qwen3-Omni model for video",
        ),
        Family(
            "qwen3_vl_moe", frozenset({"image"}), "vl", None, None, "Qwen3VLProcessor", False, True,
            video_note="Qwen3-VL video needs per-frame timestamp text, which relax-hpc does not build yet",
        ),
        Family("qwen2_5_omni", _OMNI, "omni", "video_second_per_grid", _qwen2_5_omni_audio_tokens,
               "Qwen2_5OmniProcessor", True, False),
        Family("qwen2_5_omni_thinker", _OMNI, "omni", "video_second_per_grid", _qwen2_5_omni_audio_tokens,
               "Qwen2_5OmniProcessor", False, False),
        Family("qwen3_omni_moe", _OMNI, "omni", "video_second_per_grid", _qwen3_omni_audio_tokens,
               "Qwen3OmniMoeProcessor", True, True),
        Family("qwen3_omni_moe_thinker", _OMNI, "omni", "video_second_per_grid", _qwen3_omni_audio_tokens,
               "Qwen3OmniMoeProcessor", False, True),
    )
}


def family_of(model_type: str) -> Family | None:
    """The family of a config.json `model_type`, or None for a text-only model."""
    return FAMILIES.get(model_type)


def supported_model_types() -> str:
    return ", ".join(sorted(FAMILIES))
