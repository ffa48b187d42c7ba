"""The model's own sizes against the parallel layout: heads, layers and experts must split."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from spec_example import spec_with

from relax_hpc.spec import SpecError, parse_spec
from relax_hpc.spec.model_fit import (
    ModelShape,
    check_model_fit,
    model_fit_problems,
    read_model_shape,
    shape_from_config,
)
from relax_hpc.spec.model_size import model_size

# Qwen3-4B's config.json sizes (the ones the checks read).
QWEN3_4B = {"num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 2560,
            "intermediate_size": 9728, "vocab_size": 151936, "head_dim": 128, "tie_word_embeddings": True}
QWEN3_30B_A3B = {"num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "hidden_size": 2048,
                 "intermediate_size": 6144, "vocab_size": 151936, "head_dim": 128, "num_experts": 128,
                 "moe_intermediate_size": 768, "tie_word_embeddings": False}


def megatron(**sizes: object) -> dict[str, object]:
    return {"train": {"backend": "megatron", "num_processes": 8, "megatron": sizes}}


def keys(spec_changes: dict[str, object], config: dict[str, object]) -> list[str]:
    return [p.key for p in model_fit_problems(parse_spec(spec_with(spec_changes)), shape_from_config(config))]


def test_qwen3_4b_parameter_count_is_its_name() -> None:
    # 4.02 B by Qwen's model card.
    assert 4.0e9 < model_size(QWEN3_4B).parameters < 4.05e9


def test_qwen3_30b_a3b_parameter_count_is_its_name() -> None:
    # 30.5 B by Qwen's model card, nearly all of it in the routed experts.
    size = model_size(QWEN3_30B_A3B)
    assert 30.4e9 < size.parameters < 30.6e9 and size.experts > 0.9 * size.parameters


def test_tensor_parallel_must_split_heads_and_key_value_heads() -> None:
    assert keys(megatron(tensor_parallel=8), QWEN3_4B) == []  # 32 heads, 8 kv heads: one each
    assert keys(megatron(tensor_parallel=8, pipeline_parallel=1), {**QWEN3_4B, "num_attention_heads": 36}) == [
        "train.megatron.tensor_parallel"]
    spec = parse_spec(spec_with(megatron(tensor_parallel=4)))
    problems = model_fit_problems(spec, shape_from_config({**QWEN3_4B, "num_key_value_heads": 6}))
    assert [p.key for p in problems] == ["train.megatron.tensor_parallel"]
    assert "key-value heads (6)" in problems[0].message


def test_pipeline_stages_must_split_layers() -> None:
    spec = parse_spec(spec_with(megatron(pipeline_parallel=8)))
    problems = model_fit_problems(spec, shape_from_config(QWEN3_4B))
    assert [(p.key, p.value) for p in problems] == [("train.megatron.pipeline_parallel", "8")]
    assert problems[0].message == "must divide the model's layers (36)"


def test_expert_parallel_needs_experts_that_split() -> None:
    assert keys(megatron(expert_parallel=8), QWEN3_30B_A3B) == []
    assert keys(megatron(expert_parallel=8), {**QWEN3_30B_A3B, "num_experts": 60}) == [
        "train.megatron.expert_parallel"]
    assert keys(megatron(expert_parallel=2), QWEN3_4B) == ["train.megatron.expert_parallel"]


def test_moe_under_tensor_parallelism_needs_sequence_parallelism() -> None:
    assert keys(megatron(tensor_parallel=2), QWEN3_30B_A3B) == ["train.megatron.sequence_parallel"]
    assert keys(megatron(tensor_parallel=2, sequence_parallel=True), QWEN3_30B_A3B) == []
    assert keys(megatron(tensor_parallel=2), QWEN3_4B) == []  # dense: no such rule


def test_routing_replay_needs_a_mixture_of_experts() -> None:
    changes = {**megatron(), "algorithm": {"routing_replay": True}}
    assert keys(changes, QWEN3_4B) == ["algorithm.routing_replay"]
    assert keys(changes, QWEN3_30B_A3B) == []


def test_sglang_tp_size_must_split_heads() -> None:
    changes = {"rollout": {"engine": "sglang", "sglang": {"tp_size": 3}}}
    assert keys(changes, QWEN3_4B) == ["rollout.sglang.tp_size"]


def test_nested_text_config_of_a_multimodal_model_is_read() -> None:
    omni = {"architectures": ["Qwen3OmniMoeForConditionalGeneration"],
            "thinker_config": {"text_config": QWEN3_30B_A3B, "vision_config": {"depth": 27}}}
    assert shape_from_config(omni).experts == 128


def test_check_reads_config_json_or_waits_for_the_run(tmp_path: Path) -> None:
    spec = parse_spec(spec_with({**megatron(pipeline_parallel=8), "model": {"path": str(tmp_path)}}))
    assert check_model_fit(spec, "x.toml") is None  # no config.json here yet: checked at run time
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_4B))
    with pytest.raises(SpecError) as caught:
        check_model_fit(spec, "x.toml")
    assert "x.toml: train.megatron.pipeline_parallel = 8: must divide the model's layers (36)" in str(caught.value)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(SpecError, match="cannot read the model's config"):
        check_model_fit(spec, "x.toml")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "clip"}))
    with pytest.raises(SpecError, match="not a decoder-only language model config"):
        check_model_fit(spec, "x.toml")


def test_the_tiny_model_fits_its_jobspecs(tiny_model_dir: Path) -> None:
    shape = read_model_shape(tiny_model_dir)
    assert isinstance(shape, ModelShape) and shape.layers >= 2
    spec = parse_spec(spec_with({**megatron(tensor_parallel=2), "train": {
        "backend": "megatron", "num_processes": 2, "megatron": {"tensor_parallel": 2}},
        "model": {"path": str(tiny_model_dir)}}))
    assert check_model_fit(spec, "x.toml") == shape
