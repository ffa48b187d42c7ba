"""How many parameters a model has, part by part, from its config.json alone (no torch).

`relax-hpc validate` predicts the bytes each GPU holds before a job waits in the queue, so the
count must come from the config, not from building the model. The formulas follow the Qwen
families relax-hpc trains (Qwen2/2.5/3 text and MoE models, Qwen2.5-VL, Qwen3-VL, Qwen2.5-Omni,
Qwen3-Omni): attention with or without q/k/v biases and q/k norms, dense or routed-expert MLPs,
tied or separate embeddings, and the vision and audio towers of the multimodal ones. They count
every weight, bias and norm, so for these families the count is exact (tests/spec/test_model_size.py
holds it against the tiny models `relax-hpc make-tiny` writes); for another decoder-only model it
is close (its norms or biases may differ).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["ModelSize", "language_config", "model_size"]


@dataclass(frozen=True)
class ModelSize:
    """Parameter counts of a model's parts; `largest_tensor` is the element count of its largest
    single tensor (a weight-channel bucket is at least that large)."""

    dense: int  # the language model outside its routed experts: attention, dense MLPs, routers, embeddings
    experts: int  # routed experts (what expert parallelism splits)
    vision: int = 0
    audio: int = 0
    largest_tensor: int = 0

    @property
    def parameters(self) -> int:
        return self.dense + self.experts + self.vision + self.audio


def _nested(config: Mapping[str, Any], *path: str) -> Mapping[str, Any] | None:
    node: Any = config
    for key in path:
        node = node.get(key) if isinstance(node, Mapping) else None
    return node if isinstance(node, Mapping) else None


def _model_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The config that holds the towers: an omni checkpoint's thinker, else the top level."""
    return _nested(config, "thinker_config") or config


def language_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's config: top level, or nested in multimodal configs."""
    for path in (("thinker_config", "text_config"), ("text_config",), ("llm_config",)):
        node = _nested(config, *path)
        if node is not None and "num_hidden_layers" in node:
            return node
    return config


def model_size(config: Mapping[str, Any]) -> ModelSize:
    """The parameter counts of the model a parsed config.json describes; KeyError names a size
    the config lacks. An omni checkpoint counts its thinker (the part relax-hpc trains and serves)."""
    text = language_config(config)
    model_type = str(text.get("model_type") or config.get("model_type") or "")
    dense, experts, largest = _language_parameters(text, model_type, config)
    outer = _model_config(config)
    vision_config = _nested(outer, "vision_config")
    audio_config = _nested(outer, "audio_config")
    vision = audio = 0
    if vision_config:
        vision, vision_largest = _vision_parameters(vision_config, int(text["hidden_size"]))
        largest = max(largest, vision_largest)
    if audio_config:
        audio = _audio_parameters(audio_config, int(text["hidden_size"]))
    return ModelSize(dense, experts, vision, audio, largest)


def _moe_layers(text: Mapping[str, Any], layers: int) -> int:
    """How many decoder layers have routed experts (Qwen-MoE: every `decoder_sparse_step`-th,
    except `mlp_only_layers`)."""
    step = int(text.get("decoder_sparse_step") or 1)
    dense_only = set(text.get("mlp_only_layers") or [])
    return sum(1 for i in range(layers) if i not in dense_only and (i + 1) % step == 0)


def _language_parameters(text: Mapping[str, Any], model_type: str,
                         config: Mapping[str, Any]) -> tuple[int, int, int]:
    """(dense, routed experts, largest tensor) of the language model."""
    hidden, layers, vocab = int(text["hidden_size"]), int(text["num_hidden_layers"]), int(text["vocab_size"])
    heads = int(text["num_attention_heads"])
    kv_heads = int(text.get("num_key_value_heads") or heads)
    head_dim = int(text.get("head_dim") or hidden // heads)
    # Qwen2-family attention has q/k/v biases (no config key says so); Qwen3 has q/k norms instead.
    qkv_bias = bool(text.get("attention_bias", model_type.startswith("qwen2")))
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)
    attention += head_dim * (heads + 2 * kv_heads) if qkv_bias else 0
    attention += 2 * head_dim if model_type.startswith("qwen3") else 0
    norms = 2 * hidden
    intermediate = int(text.get("intermediate_size") or 0)
    num_experts = int(text.get("num_experts") or text.get("n_routed_experts") or text.get("num_local_experts") or 0)
    moe_layers = _moe_layers(text, layers) if num_experts else 0
    expert_intermediate = int(text.get("moe_intermediate_size") or 0)
    shared = int(text.get("shared_expert_intermediate_size") or 0)
    routed_per_layer = num_experts * 3 * hidden * expert_intermediate
    # Each MoE layer: a router, and for Qwen2-MoE a gated shared expert.
    moe_dense = hidden * num_experts + (3 * hidden * shared + hidden if shared else 0)
    tied = bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))
    embeddings = vocab * hidden * (1 if tied else 2)
    dense = (layers * (attention + norms) + (layers - moe_layers) * 3 * hidden * intermediate
             + moe_layers * moe_dense + embeddings + hidden)
    largest = max(vocab * hidden, intermediate * hidden, num_experts * 2 * expert_intermediate * hidden)
    return dense, moe_layers * routed_per_layer, largest


def _vision_parameters(vision: Mapping[str, Any], text_hidden: int) -> tuple[int, int]:
    """(parameters, largest tensor) of the vision tower: patch embedding, blocks, the patch merger
    (and Qwen3's deepstack mergers)."""
    hidden = int(vision.get("hidden_size") or vision["embed_dim"])
    depth, inner = int(vision["depth"]), int(vision["intermediate_size"])
    patch = int(vision.get("patch_size") or 14)
    pixels = int(vision.get("in_channels") or 3) * int(vision.get("temporal_patch_size") or 2) * patch * patch
    merged = hidden * int(vision.get("spatial_merge_size") or 2) ** 2
    out = int(vision.get("out_hidden_size") or text_hidden)
    merger_mlp = merged * merged + merged + merged * out + out
    attention = 4 * hidden * hidden + 4 * hidden  # q, k, v and the output projection, with biases
    largest = max(pixels * hidden, merged * merged, merged * out, hidden * inner)
    if "deepstack_visual_indexes" in vision or "num_position_embeddings" in vision:
        # Qwen3-VL / Qwen3-Omni: LayerNorms with biases, a plain two-layer MLP, learned positions.
        block = 4 * hidden + attention + 2 * hidden * inner + inner + hidden
        deepstack = len(vision.get("deepstack_visual_indexes") or [])
        positions = int(vision.get("num_position_embeddings") or 0) * hidden
        return (pixels * hidden + hidden + positions + depth * block + 2 * hidden + merger_mlp
                + deepstack * (2 * merged + merger_mlp)), largest
    # Qwen2.5-VL / Qwen2.5-Omni: RMSNorms, a gated MLP with biases, no patch-embedding bias.
    block = 2 * hidden + attention + 3 * hidden * inner + 2 * inner + hidden
    return pixels * hidden + depth * block + hidden + merger_mlp, largest


def _audio_parameters(audio: Mapping[str, Any], text_hidden: int) -> int:
    """The Whisper-style audio encoder of the omni models."""
    d, ffn, layers = int(audio["d_model"]), int(audio["encoder_ffn_dim"]), int(audio["encoder_layers"])
    mel = int(audio.get("num_mel_bins") or 128)
    out = int(audio.get("output_dim") or text_hidden)
    # Per layer: q, v and output projections with biases; two LayerNorms; the feed-forward pair.
    layer = 3 * (d * d + d) + 4 * d + 2 * d * ffn + ffn + d
    if "downsample_hidden_size" in audio:
        # Qwen3-Omni: k has a bias too; three stride-2 3x3 convolutions, then projections.
        channels = int(audio["downsample_hidden_size"])
        freq = mel
        for _ in range(3):
            freq = (freq - 1) // 2 + 1
        convs = (9 * channels + channels) + 2 * (9 * channels * channels + channels)
        return (layers * (layer + d * d + d) + 2 * d + convs + d * channels * freq
                + d * d + d + d * out + out)
    # Qwen2.5-Omni: k without a bias; two 1-D convolutions, bos/eos embeddings, one projection.
    convs = (3 * d * mel + d) + (3 * d * d + d)
    return layers * (layer + d * d) + 2 * d + convs + 2 * out + d * out + out
