"""Build tiny multimodal model directories of the real Hugging Face architectures, no downloads.

The multimodal siblings of `relax_hpc.models.tiny`: Qwen2.5-VL, Qwen3-VL, Qwen2.5-Omni and
Qwen3-Omni, each randomly initialised at toy size (text tower of the tiny text model, a 2-block
vision tower, for omni a 2-layer audio encoder) and saved in the layout of the real checkpoints,
so loading, processing and weight-name handling go through the code paths a real checkout does.
Run it as `relax-hpc make-tiny DIR --kind vl|omni [--arch ARCH]`.

- The tokenizer is the text model's character-level one (same ids for every character, so the
  text task's prompts still tokenize) plus the Qwen placeholder tokens; tokenizer_config.json
  names them (`tokenizer.image_token`, `tokenizer.audio_token`, ...).
- The chat template renders one placeholder per media part; expanding it to the number of
  tokens the encoder produces is the processor's job, not the template's.
- Omni directories are the full model (model_type "qwen2_5_omni" / "qwen3_omni_moe", weights
  named ``thinker.*``) as published, with `enable_audio_output = false`, so no talker or
  token2wav weights exist. `relax_hpc.models.hf.load_policy_model` loads the thinker from them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from relax_hpc.models.mm_archs import TINY_MM_ARCHS, is_omni
from relax_hpc.models.tiny import (
    IM_END,
    IM_START,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    build_tokenizer_json,
    refuse_existing,
    save_model_dir,
    vocab_size,
)


VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
AUDIO_START = "<|audio_start|>"
AUDIO_END = "<|audio_end|>"
AUDIO_PAD = "<|audio_pad|>"
VISION_SPECIALS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)
AUDIO_SPECIALS = (AUDIO_START, AUDIO_END, AUDIO_PAD)

MAX_POSITIONS = 512
PATCH_SIZE = 8
MERGE_SIZE = 2  # 2x2 patches merge into one token: an image of grid (t, h, w) is t*h*w // 4 tokens
TEMPORAL_PATCH_SIZE = 2
MEL_BINS = 16
SAMPLING_RATE = 16000
ROPE_THETA = 10000.0
MROPE_SECTION = [2, 3, 3]  # temporal, height, width halves of head_dim 16

# The Hugging Face processor class of each family: what processor_config.json names.
PROCESSOR_CLASS = {
    "qwen2_5_vl": "Qwen2_5_VLProcessor",
    "qwen3_vl": "Qwen3VLProcessor",
    "qwen2_5_omni": "Qwen2_5OmniProcessor",
    "qwen3_omni": "Qwen3OmniMoeProcessor",
}
VIDEO_PROCESSOR_TYPE = {
    "qwen2_5_vl": "Qwen2VLVideoProcessor",
    "qwen3_vl": "Qwen3VLVideoProcessor",
    "qwen2_5_omni": "Qwen2VLVideoProcessor",
    "qwen3_omni": "Qwen2VLVideoProcessor",
}


def mm_special_tokens(arch: str) -> tuple[str, ...]:
    """The placeholder tokens `arch` adds to the text tokenizer, in id order (after the alphabet)."""
    _check_arch(arch)
    return VISION_SPECIALS + (AUDIO_SPECIALS if is_omni(arch) else ())


def mm_token_ids(arch: str) -> dict[str, int]:
    """Token -> id for every special token of `arch`'s tokenizer (base specials and placeholders)."""
    first = vocab_size()
    ids = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    return ids | {tok: first + i for i, tok in enumerate(mm_special_tokens(arch))}


def build_mm_chat_template(audio: bool) -> str:
    """tiny.py's chat template, with list contents: one placeholder per image/video/audio part.

    A string content renders exactly as in the text template. A part type the model cannot take
    (audio on a VL model, or a typo) fails the render instead of silently dropping the media.
    """
    audio_branch = (
        "{% elif part['type'] == 'audio' %}{{ '" + AUDIO_START + AUDIO_PAD + AUDIO_END + "' }}" if audio else ""
    )
    allowed = "text, image, video" + (", audio" if audio else "")
    return (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + ':' }}"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}"
        "{% if part['type'] == 'text' %}{{ part['text'] }}"
        "{% elif part['type'] == 'image' %}{{ '" + VISION_START + IMAGE_PAD + VISION_END + "' }}"
        "{% elif part['type'] == 'video' %}{{ '" + VISION_START + VIDEO_PAD + VISION_END + "' }}"
        + audio_branch
        + "{% else %}{{ raise_exception('content part type ' + part['type'] + ' is not supported by "
        "this model; use one of: " + allowed + "') }}"
        "{% endif %}{% endfor %}{% endif %}"
        "{{ '<|im_end|>' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant:' }}{% endif %}"
    )


def shape_for_engine(arch: str, on_sglang: bool) -> dict[str, int]:
    """The `write_tiny_multimodal` options a tiny `arch` model needs to be served by its engines
    (`on_sglang`: SGLang servers, `RolloutSpec.on_sglang`; else the native engine): SGLang 0.5.23's Qwen2.5-VL reads only the real models' 14-pixel
    patches (it takes rows of any other width for precomputed embeddings), and its Qwen3-Omni
    thinker (the Qwen3-VL-MoE text model) adds three deepstack features, as the real model has,
    whatever the config says."""
    if not on_sglang:
        return {}
    if arch == "qwen2_5_vl":
        return {"patch_size": 14}
    if arch == "qwen3_omni":
        return {"deepstack_layers": 3}
    return {}


def write_tiny_multimodal(out_dir: Path, arch: str, seed: int = 0, patch_size: int = PATCH_SIZE,
                          deepstack_layers: int = 1) -> Path:
    """Write a randomly initialised tiny `arch` model, tokenizer and processor configs to `out_dir`.

    Deterministic from `seed` for one transformers version. Written to a temporary directory, then
    renamed; refuses to overwrite an existing directory. `patch_size`: the vision patch side;
    `deepstack_layers`: how many vision blocks feed deepstack features to the text tower (Qwen3
    families; the vision tower is at least that deep). `shape_for_engine` says what an engine needs.
    """
    from relax_hpc.models.hf import quiet_transformers

    _check_arch(arch)
    quiet_transformers()
    out_dir = refuse_existing(out_dir)
    specials = mm_special_tokens(arch)
    torch.manual_seed(seed)
    model = _build_model(arch, mm_token_ids(arch), patch_size, deepstack_layers)
    return save_model_dir(
        model,
        out_dir,
        MAX_POSITIONS,
        tokenizer_json=build_tokenizer_json(specials),
        tokenizer_config_extra={
            "chat_template": build_mm_chat_template(audio=is_omni(arch)),
            "extra_special_tokens": _named_specials(arch),
        },
        extra_files=_processor_files(arch, patch_size),
    )


def _check_arch(arch: str) -> None:
    if arch not in TINY_MM_ARCHS:
        raise ValueError(f"unknown tiny multimodal arch {arch!r}; choose one of {', '.join(TINY_MM_ARCHS)}")


def _named_specials(arch: str) -> dict[str, str]:
    """The attributes AutoTokenizer sets from tokenizer_config.json's extra_special_tokens; the HF
    processors read them (`tokenizer.image_token`) instead of hard-coding the strings."""
    named = {"image_token": IMAGE_PAD, "video_token": VIDEO_PAD,
             "vision_bos_token": VISION_START, "vision_eos_token": VISION_END}
    if is_omni(arch):
        named |= {"audio_token": AUDIO_PAD, "audio_bos_token": AUDIO_START, "audio_eos_token": AUDIO_END}
    return named


def _text_config(arch: str, ids: dict[str, int]) -> dict[str, Any]:
    """The tiny text model's tower (tiny.TinyModelSize) with multimodal rotary sections."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": ROPE_THETA, "mrope_section": MROPE_SECTION}
    text: dict[str, Any] = {
        "vocab_size": vocab_size(mm_special_tokens(arch)),
        "hidden_size": 64,
        "intermediate_size": 192,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": MAX_POSITIONS,
        "tie_word_embeddings": True,
        "pad_token_id": ids[PAD_TOKEN],
        "bos_token_id": ids[IM_START],
        "eos_token_id": ids[IM_END],
        "rope_parameters": rope,
    }
    if arch == "qwen3_vl":
        rope["mrope_interleaved"] = True
    elif arch == "qwen3_omni":  # the thinker's text tower is MoE, as in Qwen3-Omni-30B-A3B
        rope |= {"interleaved": True, "mrope_interleaved": True}
        text |= {"moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
                 "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}
    return text


def _vision_config(arch: str, patch_size: int, deepstack_layers: int) -> dict[str, Any]:
    vision: dict[str, Any] = {
        "depth": max(2, deepstack_layers), "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": patch_size,
        "spatial_merge_size": MERGE_SIZE, "temporal_patch_size": TEMPORAL_PATCH_SIZE, "out_hidden_size": 64,
    }
    if arch in ("qwen2_5_vl", "qwen2_5_omni"):  # windowed attention, the last block full
        vision |= {"window_size": patch_size * MERGE_SIZE * 2, "fullatt_block_indexes": [1]}
    else:  # learned position embeddings and deepstack features merged into the text tower
        vision |= {"num_position_embeddings": 64, "deepstack_visual_indexes": list(range(deepstack_layers))}
    if arch == "qwen2_5_vl":
        vision["tokens_per_second"] = 2
    return vision


def _audio_config(arch: str) -> dict[str, Any]:
    audio: dict[str, Any] = {
        "num_mel_bins": MEL_BINS, "encoder_layers": 2, "encoder_attention_heads": 2, "encoder_ffn_dim": 64,
        "d_model": 32, "output_dim": 64, "max_source_positions": 200,
    }
    if arch == "qwen3_omni":
        audio |= {"downsample_hidden_size": 16, "n_window": 50, "n_window_infer": 100, "conv_chunksize": 50}
    return audio


def _build_model(arch: str, ids: dict[str, int], patch_size: int, deepstack_layers: int) -> torch.nn.Module:
    media_ids: dict[str, Any] = {
        "image_token_id": ids[IMAGE_PAD], "video_token_id": ids[VIDEO_PAD],
        "vision_start_token_id": ids[VISION_START], "vision_end_token_id": ids[VISION_END],
    }
    text, vision = _text_config(arch, ids), _vision_config(arch, patch_size, deepstack_layers)
    if arch == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

        text.pop("head_dim")  # Qwen2.5's text config derives it: hidden_size / num_attention_heads
        return Qwen2_5_VLForConditionalGeneration(
            Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **media_ids)
        )
    if arch == "qwen3_vl":
        from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

        return Qwen3VLForConditionalGeneration(
            Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **media_ids)
        )
    thinker = {
        "text_config": text, "vision_config": vision, "audio_config": _audio_config(arch),
        "audio_token_id": ids[AUDIO_PAD], "audio_start_token_id": ids[AUDIO_START],
        "audio_end_token_id": ids[AUDIO_END], "position_id_per_seconds": 25,
        "tie_word_embeddings": True, **media_ids,
    }
    if arch == "qwen2_5_omni":
        from transformers import Qwen2_5OmniConfig, Qwen2_5OmniForConditionalGeneration

        text.pop("head_dim")
        return Qwen2_5OmniForConditionalGeneration(
            Qwen2_5OmniConfig(thinker_config=thinker, enable_audio_output=False)
        )
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    return Qwen3OmniMoeForConditionalGeneration(Qwen3OmniMoeConfig(thinker_config=thinker, enable_audio_output=False))


def _processor_files(arch: str, patch_size: int) -> dict[str, str]:
    """processor_config.json (and for VL preprocessor_config.json), as transformers writes them.

    An omni processor has two "preprocessors" (image and audio) that would both save as
    preprocessor_config.json, so transformers nests them in processor_config.json; VL checkouts
    carry the image processor at the top level too. The video processor's config is written by
    hand: its classes need torchvision, which a training node need not have.
    """
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    size = {"shortest_edge": 16 * 16, "longest_edge": 64 * 64}
    geometry: dict[str, Any] = {"patch_size": patch_size, "merge_size": MERGE_SIZE, "temporal_patch_size": TEMPORAL_PATCH_SIZE}
    image = Qwen2VLImageProcessorPil(**geometry, size=size)
    image_dict = image.to_dict()
    video_dict = {key: image_dict[key] for key in (
        "do_convert_rgb", "do_normalize", "do_rescale", "do_resize", "image_mean", "image_std",
        "resample", "rescale_factor",
    ) if key in image_dict} | geometry | {"size": size, "video_processor_type": VIDEO_PROCESSOR_TYPE[arch]}
    processor: dict[str, Any] = {"processor_class": PROCESSOR_CLASS[arch], "image_processor": image_dict,
                                 "video_processor": video_dict}
    files: dict[str, str] = {}
    if is_omni(arch):
        from transformers import WhisperFeatureExtractor

        audio = WhisperFeatureExtractor(feature_size=MEL_BINS, sampling_rate=SAMPLING_RATE, hop_length=160,
                                        chunk_length=30, n_fft=400)
        processor["feature_extractor"] = audio.to_dict()
    else:
        files["preprocessor_config.json"] = image.to_json_string()
    files["processor_config.json"] = json.dumps(processor, indent=2, sort_keys=True) + "\n"
    return files
