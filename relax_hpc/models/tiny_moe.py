"""Build a tiny Qwen3-MoE model directory locally, with no downloads.

The mixture-of-experts sibling of `relax_hpc.models.tiny` (same character-level tokenizer and
chat template): every decoder layer's MLP is a sparse block of `num_experts` experts with top-k
routing, as in Qwen3-30B-A3B. It is saved in the per-expert Hugging Face layout
(``mlp.experts.<e>.gate_proj`` ...), which transformers 4.x and 5.x both load and megatron-bridge's
``Qwen3MoEBridge`` maps, so the native engine and the Megatron trainer read the same weights. It
exists to test routing replay (R3, docs/backends.md) on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from relax_hpc.models.tiny import (
    IM_END,
    IM_START,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    refuse_existing,
    save_model_dir,
    vocab_size,
)

ROPE_THETA = 10000.0


@dataclass(frozen=True)
class TinyMoeSize:
    """Shape of the tiny MoE model: a few experts, top-2, tiny dimensions."""

    hidden_size: int = 64
    moe_intermediate_size: int = 32
    num_experts: int = 8
    num_experts_per_tok: int = 2
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    max_position_embeddings: int = 256
    initializer_range: float = 0.02  # std of the random weights (Hugging Face's default)


def write_tiny_moe_model(out_dir: Path, seed: int = 0, size: TinyMoeSize = TinyMoeSize()) -> Path:
    """Write a randomly initialised tiny Qwen3-MoE model + tokenizer to `out_dir`.

    Deterministic from `seed` for one transformers version (the weights come from the model's
    own initialisation). Written to a temporary directory, then renamed; refuses to overwrite.
    """
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from relax_hpc.models.hf import quiet_transformers

    quiet_transformers()
    out_dir = refuse_existing(out_dir)
    token_ids = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    # A dict: the keyword set of Qwen3MoeConfig differs between transformers 4.x and 5.x.
    fields: dict[str, Any] = {
        "vocab_size": vocab_size(),
        "hidden_size": size.hidden_size,
        "intermediate_size": 4 * size.moe_intermediate_size,  # dense MLP size, unused: every layer is sparse
        "moe_intermediate_size": size.moe_intermediate_size,
        "num_experts": size.num_experts,
        "num_experts_per_tok": size.num_experts_per_tok,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_hidden_layers": size.num_hidden_layers,
        "num_attention_heads": size.num_attention_heads,
        "num_key_value_heads": size.num_key_value_heads,
        "head_dim": size.head_dim,
        "rope_theta": ROPE_THETA,
        "max_position_embeddings": size.max_position_embeddings,
        "initializer_range": size.initializer_range,
        "tie_word_embeddings": True,
        "pad_token_id": token_ids[PAD_TOKEN],
        "bos_token_id": token_ids[IM_START],
        "eos_token_id": token_ids[IM_END],
    }
    config = Qwen3MoeConfig(**fields)
    torch.manual_seed(seed)
    # transformers 5 saves `num_local_experts` and `rope_parameters`; 4.x (megatron-bridge's side)
    # reads only `num_experts` and `rope_theta` and would silently fall back to 128 experts.
    both_spellings = {"num_experts": size.num_experts, "num_local_experts": size.num_experts,
                      "rope_theta": ROPE_THETA}
    return save_model_dir(Qwen3MoeForCausalLM(config), out_dir, size.max_position_embeddings, both_spellings)
