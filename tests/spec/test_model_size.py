"""Parameter counts from config.json alone, against hand arithmetic and the tiny models' own tensors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from model_configs import TINY_QWEN3

from relax_hpc.spec.model_size import model_size


def test_a_qwen3_text_model_is_counted_weight_by_weight() -> None:
    # Per layer: q, k, v, o = 64*16*(2*4 + 2*2) = 12288; q/k norms 2*16 = 32; two RMSNorms 2*64 = 128;
    # gated MLP 3*64*192 = 36864; so 49312. Two layers 98624, tied embeddings 48*64 = 3072,
    # final norm 64: 101760.
    size = model_size(TINY_QWEN3)
    assert (size.dense, size.experts, size.vision, size.audio) == (101760, 0, 0, 0)
    untied = model_size({**TINY_QWEN3, "tie_word_embeddings": False})
    assert untied.parameters == 101760 + 3072  # the output projection is its own matrix


def test_routed_experts_are_counted_apart_from_the_dense_part() -> None:
    moe = {**TINY_QWEN3, "model_type": "qwen3_moe", "num_experts": 8, "moe_intermediate_size": 32,
           "mlp_only_layers": [1]}
    size = model_size(moe)
    # Layer 0 is MoE: 8 experts * 3*64*32 = 49152 routed, a router 64*8 = 512; layer 1 keeps the
    # dense MLP (mlp_only_layers) of 36864.
    assert size.experts == 49152
    assert size.dense == 3072 + 64 + 2 * (12288 + 32 + 128) + 512 + 36864


def test_qwen2_attention_has_biases_and_no_qk_norms() -> None:
    qwen2 = {**TINY_QWEN3, "model_type": "qwen2"}
    # + q/k/v biases 16*(4 + 2*2) = 128, - q/k norms 32, per layer.
    assert model_size(qwen2).parameters == 101760 + 2 * (128 - 32)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from relax_hpc.models.tiny_mm import write_tiny_multimodal
    from relax_hpc.models.tiny_moe import write_tiny_moe_model

    base = tmp_path_factory.mktemp("sizes")
    dirs = {arch: write_tiny_multimodal(base / arch, arch) for arch in ("qwen2_5_vl", "qwen3_vl", "qwen2_5_omni",
                                                                        "qwen3_omni")}
    dirs["qwen3_moe"] = write_tiny_moe_model(base / "moe")
    return dirs


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl", "qwen2_5_omni", "qwen3_omni", "qwen3_moe"])
def test_the_count_is_exact_for_every_tiny_family(arch: str, tiny_models: dict[str, Path]) -> None:
    from relax_hpc.models.hf import load_policy_model

    path = tiny_models[arch]
    model = load_policy_model(str(path), dtype="float32", device="cpu")
    tensors = dict(model.named_parameters())
    size = model_size(json.loads((path / "config.json").read_text()))
    assert size.parameters == sum(t.numel() for t in tensors.values())
    assert size.vision == sum(t.numel() for n, t in tensors.items() if ".visual." in f".{n}")
    assert size.audio == sum(t.numel() for n, t in tensors.items() if "audio_tower." in n)
    assert size.experts == sum(t.numel() for n, t in tensors.items() if ".experts." in n)
    assert size.largest_tensor == max(t.numel() for t in tensors.values())
