"""Refusals the trainer makes at start for a reason the spec and the model's config.json show,
made by `relax-hpc validate` instead, each with a counter-case that passes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from model_configs import QWEN3_4B, QWEN3_OMNI_30B_A3B, QWEN3_VL_4B
from spec_example import spec_with

from relax_hpc.backends.spec_checks import backend_support_problems, check_backend_support
from relax_hpc.cli.main import main
from relax_hpc.spec import SpecError, parse_spec

GPT2 = {"model_type": "gpt2", "n_layer": 2, "n_head": 4, "n_embd": 64, "vocab_size": 48}
OPT = {"model_type": "opt", "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64, "ffn_dim": 256,
       "vocab_size": 48}
MEGATRON = {"backend": "megatron", "num_processes": 2}


def problems(changes: dict[str, Any], config: dict[str, Any] | None,
             teacher: dict[str, Any] | None = None) -> list[tuple[str, str]]:
    found = backend_support_problems(parse_spec(spec_with(changes)), config, teacher)
    return [(p.key, p.message) for p in found]


def model_dir(root: Path, name: str, config: dict[str, Any]) -> str:
    path = root / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def test_context_parallel_is_refused_at_parse_time() -> None:
    # MegatronLayout.problems refuses it at start on any machine, Transformer Engine or not.
    with pytest.raises(SpecError) as caught:
        parse_spec(spec_with({"train": {**MEGATRON, "megatron": {"context_parallel": 2}}}))
    (problem,) = caught.value.problems
    assert problem.key == "train.megatron.context_parallel" and problem.value == "2"
    assert "Transformer Engine" in problem.message and "set context_parallel = 1" in problem.message
    assert parse_spec(spec_with({"train": {**MEGATRON, "megatron": {"tensor_parallel": 2}}}))


def test_a_remote_reward_needs_its_url_at_parse_time() -> None:
    # The reward hub would refuse it at the first scored sample.
    with pytest.raises(SpecError) as caught:
        parse_spec(spec_with({"reward": {"function": "remote_rm"}}))
    (problem,) = caught.value.problems
    assert problem.key == "reward.remote_url" and 'reward.function = "remote_rm"' in problem.message
    assert parse_spec(spec_with({"reward": {"function": "remote_rm", "remote_url": "http://judge:8000/score"}}))


def test_the_clip_floor_must_stay_positive_at_parse_time() -> None:
    # The policy loss would refuse it at the first step (ratio floor 1 - clip_eps_low).
    with pytest.raises(SpecError) as caught:
        parse_spec(spec_with({"algorithm": {"clip_eps_low": 1.0}}))
    (problem,) = caught.value.problems
    assert problem.key == "algorithm.clip_eps_low" and "must be below 1" in problem.message
    assert parse_spec(spec_with({"algorithm": {"clip_eps_low": 0.99}}))


def test_fsdp2_refuses_a_model_whose_blocks_it_cannot_find() -> None:
    fsdp2 = {"train": {"strategy": "fsdp2", "num_processes": 2}}
    ((key, message),) = problems(fsdp2, OPT)
    assert key == "train.strategy" and "model_type opt keeps its blocks at model.decoder.layers" in message
    assert 'use strategy = "ddp"' in message and message.endswith("(from config.json)")
    assert problems(fsdp2, GPT2)[0][0] == "train.strategy"
    assert problems({"train": {"num_processes": 2}}, OPT) == []  # ddp wraps the whole model
    # Text models with their blocks at model.layers, and the VL / Omni families (towers as units).
    assert problems(fsdp2, QWEN3_4B) == problems(fsdp2, QWEN3_VL_4B) == problems(fsdp2, QWEN3_OMNI_30B_A3B) == []


def test_megatron_refuses_a_multimodal_model_from_its_config_or_its_arch() -> None:
    ((key, message),) = problems({"train": MEGATRON}, QWEN3_VL_4B)
    assert key == "train.backend" and "qwen3_vl (from config.json) is multimodal" in message
    assert 'set backend = "torch"' in message
    # No config.json here: `[model] arch` says what the cluster's model is.
    ((key, message),) = problems({"train": MEGATRON, "model": {"arch": "qwen3_omni", "build_tiny_if_missing": False}},
                                 None)
    assert key == "train.backend" and "qwen3_omni_moe (from [model] arch)" in message
    assert problems({"train": MEGATRON}, QWEN3_4B) == []
    assert problems({"train": MEGATRON, "model": {"build_tiny_if_missing": False}}, None) == []  # nothing known


def test_megatron_refuses_a_mixture_of_experts_model_on_cpu() -> None:
    moe = {**QWEN3_4B, "model_type": "qwen3_moe", "num_experts": 8, "moe_intermediate_size": 32}
    ((key, message),) = problems({"train": {**MEGATRON, "device": "cpu"}}, moe)
    assert key == "train.device" and "grouped-GEMM" in message and 'device = "cuda"' in message
    gpus = {"cluster": {"trainer": {"gpus_per_node": 2}}}
    assert problems({"train": {**MEGATRON, "device": "cuda"}, **gpus}, moe) == []
    assert problems({"train": {**MEGATRON, "device": "cpu"}}, QWEN3_4B) == []  # dense: fine on CPU


def test_opd_refuses_a_multimodal_teacher(tmp_path: Path) -> None:
    student = model_dir(tmp_path, "student", QWEN3_4B)
    opd = {"model": {"path": student, "build_tiny_if_missing": False},
           "algorithm": {"name": "opd", "opd_teacher_path": model_dir(tmp_path, "vl", QWEN3_VL_4B)}}
    with pytest.raises(SpecError) as caught:
        check_backend_support(parse_spec(spec_with(opd)), "x.toml")
    (problem,) = caught.value.problems
    assert problem.key == "algorithm.opd_teacher_path" and "text-only teacher" in problem.message
    opd["algorithm"]["opd_teacher_path"] = model_dir(tmp_path, "text", QWEN3_4B)
    check_backend_support(parse_spec(spec_with(opd)), "x.toml")


def test_validate_refuses_a_run_time_refusal_with_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = tmp_path / "s.toml"
    spec.write_text(spec_with({"model": {"path": model_dir(tmp_path, "opt", OPT), "build_tiny_if_missing": False},
                               "train": {"strategy": "fsdp2", "num_processes": 2}}))
    assert main(["validate", str(spec)]) == 2
    assert "train.strategy = 'fsdp2': wraps each decoder layer at model.layers" in capsys.readouterr().err


def test_validate_refuses_video_an_sglang_server_on_cpu_cannot_decode(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    omni = model_dir(tmp_path, "omni", QWEN3_OMNI_30B_A3B)
    spec = tmp_path / "s.toml"
    changes = {"model": {"path": omni, "build_tiny_if_missing": False}, "data": {"video_key": "video"},
               "rollout": {"engine": "sglang"}, "train": {"device": "cpu"}}
    spec.write_text(spec_with(changes))
    assert main(["validate", str(spec)]) == 2
    assert "data.video_key" in capsys.readouterr().err
    changes["rollout"] = {"engine": "native"}
    spec.write_text(spec_with(changes))
    assert main(["validate", str(spec)]) == 0


REPO = Path(__file__).resolve().parents[2]
PRODUCTION = ("qwen3_omni", "qwen3_vl_4b_openr1", "qwen3_4b_dapo")


@pytest.mark.parametrize("name", PRODUCTION)
def test_the_production_specs_validate_here_with_the_model_checks_said_skipped(
        name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(REPO / "jobspecs" / f"{name}.toml")]) == 0
    out = capsys.readouterr().out
    assert "no config.json readable here, so the checks that need it are skipped until the job runs" in out


def test_a_production_spec_is_refused_from_its_arch_where_the_model_is_not_mounted(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = (REPO / "jobspecs" / "qwen3_omni.toml").read_text()
    spec = tmp_path / "omni_megatron.toml"
    spec.write_text(text.replace('backend = "torch"', 'backend = "megatron"'))
    assert main(["validate", str(spec)]) == 2
    assert "train.backend = 'megatron': builds the language model only, and qwen3_omni_moe (from [model] arch)" \
        in capsys.readouterr().err


def test_a_critic_strategy_its_value_model_cannot_use_is_refused() -> None:
    gae = {"algorithm": {"advantage": "gae"}}
    assert problems({**gae, "critic": {"strategy": "fsdp2"}}, QWEN3_4B) == []
    assert problems({**gae, "critic": {"strategy": "ddp"}}, GPT2) == []
    ((key, message),) = problems({**gae, "critic": {"strategy": "fsdp2"}}, GPT2)
    assert key == "critic.strategy" and "transformer.h" in message and 'critic.strategy = "ddp"' in message
    # Unset, it follows train.strategy: the trainer's refusal and the critic's are both named.
    found = problems({**gae, "train": {"strategy": "fsdp2"}, "critic": {}}, GPT2)
    assert [k for k, _ in found] == ["train.strategy", "critic.strategy"] and "follows train.strategy" in found[1][1]
    ((key, message),) = problems({**gae, "critic": {"strategy": "fsdp2"}}, QWEN3_VL_4B)
    assert key == "critic.strategy" and "multimodal" in message and "reads no media" in message
