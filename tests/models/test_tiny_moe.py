"""The tiny Qwen3-MoE directory: deterministic from its seed, loads through the stock HF entry
points as a sparse model, and carries the config keys both transformers 4.x and 5.x read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from relax_hpc.models import tiny
from relax_hpc.models.tiny_moe import TinyMoeSize, write_tiny_moe_model


def test_loads_as_a_sparse_qwen3_moe(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    path = write_tiny_moe_model(tmp_path / "moe", seed=0)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert model.config.num_experts == 8 and model.config.num_experts_per_tok == 2
    assert model.config.vocab_size == tiny.vocab_size()
    assert all(hasattr(layer.mlp, "experts") for layer in model.model.layers)
    assert torch.isfinite(model(input_ids=torch.tensor([[4, 5, 13]])).logits).all()
    config = json.loads((path / "config.json").read_text())
    # transformers 4.x (megatron-bridge's side) reads these spellings; 5.x writes the others.
    assert config["num_experts"] == config["num_local_experts"] == 8
    assert config["rope_theta"] == 10000.0


def test_deterministic_from_the_seed_and_refuses_to_overwrite(tmp_path: Path) -> None:
    size = TinyMoeSize(num_hidden_layers=1)
    a = write_tiny_moe_model(tmp_path / "a", seed=3, size=size)
    b = write_tiny_moe_model(tmp_path / "b", seed=3, size=size)
    c = write_tiny_moe_model(tmp_path / "c", seed=4, size=size)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    with pytest.raises(FileExistsError, match="already exists"):
        write_tiny_moe_model(a, seed=3, size=size)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "c"]  # no temporary left behind
