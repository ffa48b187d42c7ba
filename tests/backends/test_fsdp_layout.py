"""Where FSDP2 cuts a model into units: from config.json alone (`fsdp2_refusal`, for `validate`)
and on the built model (`fsdp_units`), which must agree; the refusals; float32 masters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from relax_hpc.backends.fsdp_layout import OMNI_LAYOUT, TEXT_LAYOUT, VL_LAYOUT, fsdp2_layout, fsdp2_refusal
from relax_hpc.backends.parallel import fsdp_units, keep_float32_masters, shard_model
from relax_hpc.models.hf import MULTIMODAL_FAMILIES, load_policy_model
from relax_hpc.models.tiny_mm import TINY_MM_ARCHS, write_tiny_multimodal


@pytest.fixture(scope="module")
def mm_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("layout")
    return {arch: write_tiny_multimodal(root / arch, arch, seed=0) for arch in TINY_MM_ARCHS}


@pytest.mark.parametrize("arch", TINY_MM_ARCHS)
def test_units_are_where_the_config_says(mm_dirs: dict[str, Path], arch: str) -> None:
    """What `validate` reads from config.json names the modules `shard_model` wraps."""
    config = json.loads((mm_dirs[arch] / "config.json").read_text())
    assert fsdp2_refusal(config) is None
    layout = fsdp2_layout(config)
    assert layout == (OMNI_LAYOUT if arch.endswith("omni") else VL_LAYOUT)
    units = fsdp_units(load_policy_model(mm_dirs[arch]))
    assert [path for path, _ in units.layers] == [f"{layout.layers}.{i}" for i in range(2)]
    assert tuple(path for path, _ in units.towers) == layout.towers


def test_text_model_units(tiny_model_dir: Path) -> None:
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert fsdp2_refusal(config) is None and fsdp2_layout(config) == TEXT_LAYOUT
    units = fsdp_units(load_policy_model(tiny_model_dir))
    assert [path for path, _ in units.layers] == ["model.layers.0", "model.layers.1"] and units.towers == []


def test_every_trained_multimodal_family_has_a_layout() -> None:
    for model_type in MULTIMODAL_FAMILIES:
        assert fsdp2_refusal({"model_type": model_type}) is None, model_type


@pytest.mark.parametrize(("config", "words"), [
    ({"model_type": "gpt2"}, ("transformer.h", "strategy = \"ddp\"")),
    ({"model_type": "opt"}, ("model.decoder.layers", "strategy = \"ddp\"")),
    ({"model_type": "llava", "vision_config": {}}, ("llava", "vision_config", "qwen3_vl", "strategy = \"ddp\"")),
    ({}, ("model_type", "[model] path")),
])
def test_refusals_name_the_problem_and_the_way_out(config: dict, words: tuple[str, ...]) -> None:
    reason = fsdp2_refusal(config)
    assert reason is not None and all(w in reason for w in words), reason
    with pytest.raises(ValueError, match="fsdp2"):
        fsdp2_layout(config)


def test_a_model_without_decoder_layers_is_refused_before_any_collective() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8))
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel has none at transformer\.layers.*strategy = \"ddp\""):
        shard_model(model, torch.device("cpu"))  # no process group: it fails before needing one


def test_float32_masters_keep_ties_and_record_the_loaded_dtypes(tiny_model_dir: Path) -> None:
    model = load_policy_model(tiny_model_dir, dtype="bfloat16")
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the tiny model ties them
    loaded = keep_float32_masters(model)
    assert set(loaded.values()) == {torch.bfloat16} and loaded.keys() == model.state_dict().keys()
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert model.lm_head.weight is model.model.embed_tokens.weight
    # On the meta device too (a model built empty, to be sharded and filled): no storage needed.
    with torch.device("meta"):
        empty = type(model)(model.config).to(torch.bfloat16)
    keep_float32_masters(empty)
    assert {(p.device.type, p.dtype) for p in empty.parameters()} == {("meta", torch.float32)}
