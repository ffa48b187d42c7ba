"""Model configs for the spec tests: a small Qwen3 (the sizes of `relax-hpc make-tiny`'s text
model), and the production specs' models as their published config.json files give them (only
the keys the checks and the memory estimate read), for tests that must not download them."""

from __future__ import annotations

from typing import Any

TINY_QWEN3: dict[str, Any] = {
    "model_type": "qwen3", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "hidden_size": 64, "intermediate_size": 192, "vocab_size": 48, "tie_word_embeddings": True,
}

QWEN3_4B: dict[str, Any] = {
    "model_type": "qwen3", "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
    "hidden_size": 2560, "intermediate_size": 9728, "vocab_size": 151936, "head_dim": 128,
    "tie_word_embeddings": True,
}

QWEN3_VL_4B: dict[str, Any] = {
    "model_type": "qwen3_vl", "tie_word_embeddings": True,
    "text_config": {**QWEN3_4B, "model_type": "qwen3_vl_text"},
    "vision_config": {"depth": 24, "hidden_size": 1024, "intermediate_size": 4096, "num_heads": 16,
                      "out_hidden_size": 2560, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                      "in_channels": 3, "num_position_embeddings": 2304, "deepstack_visual_indexes": [5, 11, 17]},
}

QWEN3_OMNI_30B_A3B: dict[str, Any] = {
    "model_type": "qwen3_omni_moe",
    "thinker_config": {
        "model_type": "qwen3_omni_moe_thinker",
        "text_config": {"model_type": "qwen3_omni_moe_text", "num_hidden_layers": 48, "num_attention_heads": 32,
                        "num_key_value_heads": 4, "head_dim": 128, "hidden_size": 2048, "intermediate_size": 768,
                        "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
                        "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 152064,
                        "tie_word_embeddings": False},
        "vision_config": {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
                          "out_hidden_size": 2048, "patch_size": 16, "spatial_merge_size": 2,
                          "temporal_patch_size": 2, "in_channels": 3, "num_position_embeddings": 2304,
                          "deepstack_visual_indexes": [8, 16, 24]},
        "audio_config": {"d_model": 1280, "encoder_layers": 32, "encoder_ffn_dim": 5120,
                         "encoder_attention_heads": 20, "num_mel_bins": 128, "output_dim": 2048,
                         "downsample_hidden_size": 480},
    },
}
