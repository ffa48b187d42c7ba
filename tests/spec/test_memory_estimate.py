"""Predicted bytes per GPU for each component, worked by hand for a small config, and the refusal
of a layout that cannot fit its GPUs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from model_configs import QWEN3_4B, QWEN3_OMNI_30B_A3B, QWEN3_VL_4B, TINY_QWEN3
from spec_example import spec_with

from relax_hpc.cli.main import main
from relax_hpc.spec import JobSpec, load_spec, parse_spec
from relax_hpc.spec.memory_estimate import (
    CHANNEL_BUCKET_BYTES,
    GB,
    ComponentMemory,
    memory_estimate,
    memory_problems,
    per_gpu_bytes,
)

REPO = Path(__file__).resolve().parents[2]
P = 101760  # TINY_QWEN3's parameters (test_model_size.py works them out)
GPUS = {"cluster": {"trainer": {"gpus_per_node": 8}, "rollout": {"gpus_per_node": 8}}}


def spec(changes: dict[str, Any]) -> JobSpec:
    return parse_spec(spec_with({"model": {"dtype": "bfloat16"}, **changes}))


def by_name(records: tuple[ComponentMemory, ...]) -> dict[str, ComponentMemory]:
    return {r.name: r for r in records}


def test_a_ddp_trainer_keeps_float32_weights_gradients_and_adam_moments() -> None:
    got = by_name(memory_estimate(spec({}), TINY_QWEN3))
    # bf16 model, torch backend: float32 parameters 4P, gradients 4P, two moments 8P. The whole
    # model is 2P bytes on the wire, smaller than one 512 MiB bucket, so each of the two staging
    # buffers holds all of it.
    assert got["trainer"] == ComponentMemory("trainer", "trainer", parameters=4 * P, gradients=4 * P,
                                             optimizer=8 * P, channel_buffers=2 * 2 * P)
    # One native engine computes on the received buffer (2P) and keeps a spare for the next version.
    assert got["rollout engine"] == ComponentMemory("rollout engine", "rollout", engine_weights=2 * P,
                                                    channel_buffers=2 * P)
    assert set(got) == {"trainer", "rollout engine"}


def test_fsdp2_shards_the_trainer_state_over_the_ranks() -> None:
    sharded = spec({"train": {"strategy": "fsdp2", "num_processes": 4}})
    trainer = by_name(memory_estimate(sharded, TINY_QWEN3))["trainer"]
    # A quarter of 4P, 4P and 8P per rank; the staging buffers are not sharded.
    assert (trainer.parameters, trainer.gradients, trainer.optimizer) == (P, P, 2 * P)
    assert trainer.channel_buffers == 4 * P


def test_megatron_splits_by_tensor_parallel_and_the_optimizer_by_data_parallel() -> None:
    changes = {"train": {"backend": "megatron", "num_processes": 4,
                         "megatron": {"tensor_parallel": 2, "distributed_optimizer": True}}}
    trainer = by_name(memory_estimate(spec(changes), TINY_QWEN3))["trainer"]
    # TP=2: P/2 parameters per rank, in bf16 (2 bytes), float32 main gradients (4 bytes); the
    # optimizer's float32 master copy and two moments (12 bytes) over DP = 4 / 2 = 2 ranks.
    assert (trainer.parameters, trainer.gradients, trainer.optimizer) == (P, 2 * P, 3 * P)


def test_experts_are_split_over_expert_parallel_ranks_too() -> None:
    moe = {**TINY_QWEN3, "model_type": "qwen3_moe", "num_experts": 8, "moe_intermediate_size": 32}
    changes = {"train": {"backend": "megatron", "num_processes": 2, "device": "cuda",
                         "megatron": {"expert_parallel": 2}}, **GPUS}
    # Dense: 3072 + 64 + 2 * (12288 + 32 + 128 + 512) = 29056; experts 2 * 8 * 3*64*32 = 98304,
    # half of them per rank with EP = 2; in bf16, 2 bytes each.
    trainer = by_name(memory_estimate(spec(changes), moe))["trainer"]
    assert trainer.parameters == (29056 + 98304 // 2) * 2
    float32 = parse_spec(spec_with({**changes, "model": {"dtype": "float32"}}))
    trainer = by_name(memory_estimate(float32, moe))["trainer"]
    # A float32 model has no separate master copy: 8 bytes of moments, over no data-parallel split.
    assert trainer.optimizer == (29056 + 98304 // 2) * 8


def test_sglang_engines_split_their_weights_over_tp_size() -> None:
    engine = by_name(memory_estimate(spec({"rollout": {"engine": "sglang", "sglang": {"tp_size": 2}}}),
                                     TINY_QWEN3))["rollout engine"]
    # 2P bytes over 2 GPUs; the server takes one update bucket (here the whole 2P) and the rollout
    # role passes versions through two staging buffers (2 * 2P).
    assert engine.engine_weights == P and engine.channel_buffers == 2 * P + 4 * P


def test_the_reference_is_sharded_like_the_policy_and_roles_hold_whole_models() -> None:
    changes = {"algorithm": {"kl_coef": 0.1}, "train": {"strategy": "fsdp2", "num_processes": 2}}
    got = by_name(memory_estimate(spec(changes), TINY_QWEN3))
    assert got["reference"] == ComponentMemory("reference", "trainer", parameters=2 * P // 2)
    roles = by_name(memory_estimate(spec({"algorithm": {"kl_coef": 0.1},
                                          "train": {"reference_role": True, "actor_fwd_role": True}}), TINY_QWEN3))
    assert "reference" not in roles
    assert roles["reference role"] == ComponentMemory("reference role", "trainer", parameters=2 * P)
    assert roles["actor_fwd"].parameters == roles["actor_fwd"].channel_buffers == 2 * P


def test_colocated_gpus_hold_the_larger_of_the_two_phases() -> None:
    colocated = spec({"job": {"mode": "colocate"}, "cluster": {"colocate": True, "trainer": {"gpus_per_node": 1}}})
    records = memory_estimate(colocated, TINY_QWEN3)
    # Training: 4P + 4P + 8P + 4P (staging) = 20P. Generating: gradients and moments offloaded,
    # 4P + 4P + the engine's 2P + 2P = 12P. The engine has no component of its own.
    assert per_gpu_bytes(colocated, records) == {"trainer": 20 * P}
    assert by_name(records)["rollout engine"].cluster == "trainer"


def test_the_bucket_is_the_weight_channels() -> None:
    from relax_hpc.weights.channel import DEFAULT_BUCKET_BYTES

    assert CHANNEL_BUCKET_BYTES == DEFAULT_BUCKET_BYTES


def test_a_layout_that_cannot_fit_is_refused_naming_the_component_and_what_to_change() -> None:
    engines = {"engine": "sglang", "sglang": {"tp_size": 2}}
    ddp = spec({"train": {"num_processes": 8, "device": "cuda"}, "rollout": engines, **GPUS})
    problems = memory_problems(ddp, memory_estimate(ddp, QWEN3_OMNI_30B_A3B))
    assert [p.key for p in problems] == ["cluster.trainer.gpu_memory_gb"]
    # 31.7 B parameters * 16 bytes on every rank: ~509 GB.
    assert problems[0].value == "80.0" and "is below the ~509.1 GB predicted per GPU (trainer 509.1 GB" \
        in problems[0].message
    assert 'strategy = "fsdp2"' in problems[0].message
    sharded = spec({"train": {"num_processes": 8, "device": "cuda", "strategy": "fsdp2"}, "rollout": engines, **GPUS})
    assert memory_problems(sharded, memory_estimate(sharded, QWEN3_OMNI_30B_A3B)) == []


def test_an_engine_that_cannot_fit_is_refused_with_tp_size_named() -> None:
    small = {"cluster": {"trainer": {"gpus_per_node": 8}, "rollout": {"gpus_per_node": 8, "gpu_memory_gb": 48}}}
    one = spec({"rollout": {"engine": "sglang"}, "train": {"strategy": "fsdp2", "num_processes": 8}, **small})
    problems = memory_problems(one, memory_estimate(one, QWEN3_OMNI_30B_A3B))
    assert [p.key for p in problems] == ["cluster.rollout.gpu_memory_gb"]
    assert "raise [rollout.sglang] tp_size (now 1)" in problems[0].message
    two = spec({"rollout": {"engine": "sglang", "sglang": {"tp_size": 2}},
                "train": {"strategy": "fsdp2", "num_processes": 8}, **small})
    assert memory_problems(two, memory_estimate(two, QWEN3_OMNI_30B_A3B)) == []
    on_cpu = spec({"rollout": {"engine": "sglang"}, "train": {"device": "cpu"}, **small})
    assert memory_problems(on_cpu, memory_estimate(on_cpu, QWEN3_OMNI_30B_A3B)) == []  # no GPU to fill


@pytest.mark.parametrize(("name", "config", "trainer_gb"), [
    ("qwen3_omni", QWEN3_OMNI_30B_A3B, (60, 70)),  # 31.7 B * 16 bytes / 8 ranks + staging
    ("qwen3_vl_4b_openr1", QWEN3_VL_4B, (15, 22)),  # 4.4 B * 16 / 4
    ("qwen3_4b_dapo", QWEN3_4B, (30, 45)),  # 4.0 B * (2 + 4 + 12) / TP 2
])
def test_the_production_specs_fit_their_gpus(name: str, config: dict[str, Any],
                                             trainer_gb: tuple[float, float]) -> None:
    production = load_spec(REPO / "jobspecs" / f"{name}.toml")
    records = memory_estimate(production, config)
    assert memory_problems(production, records) == []
    low, high = trainer_gb
    assert low * GB < per_gpu_bytes(production, records)["trainer"] < high * GB


def test_validate_prints_each_component_and_refuses_what_cannot_fit(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_QWEN3))
    text = spec_with({"model": {"path": str(model), "build_tiny_if_missing": False, "dtype": "bfloat16"},
                      "train": {"device": "cuda"}, "cluster": {"trainer": {"gpus_per_node": 1},
                                                               "rollout": {"gpus_per_node": 1}}})
    path = tmp_path / "s.toml"
    path.write_text(text)
    assert main(["validate", str(path)]) == 0
    out = capsys.readouterr().out
    assert "model: 0.10 M parameters; predicted per GPU" in out
    # 4P + 4P + 8P + 4P = 20P = 2035200 bytes = 1.9 MiB.
    assert "  trainer (cluster.trainer): 1.9 MiB = parameters 0.4 MiB + gradients 0.4 MiB + optimizer 0.8 MiB" in out
    assert "busiest GPU of cluster.trainer: 1.9 MiB of gpu_memory_gb = 80 GB" in out
    path.write_text(text.replace("[cluster.trainer]", "[cluster.trainer]\ngpu_memory_gb = 0.001"))
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "cluster.trainer.gpu_memory_gb = 0.001: is below the ~1.9 MiB predicted per GPU" in err


def test_the_distributed_optimizer_splits_experts_over_their_own_data_parallel_ranks() -> None:
    moe = {**TINY_QWEN3, "model_type": "qwen3_moe", "num_experts": 8, "moe_intermediate_size": 32}
    changes = {"train": {"backend": "megatron", "num_processes": 4, "device": "cuda",
                         "megatron": {"expert_parallel": 2, "distributed_optimizer": True}}, **GPUS}
    trainer = by_name(memory_estimate(spec(changes), moe))["trainer"]
    # Dense 29056 parameters on every rank, their 12 optimizer bytes over DP = 4 ranks; experts
    # 98304 / EP 2 per rank, their state over the expert data-parallel size 4 / 2 = 2.
    assert trainer.optimizer == 29056 * 12 // 4 + 98304 // 2 * 12 // 2


def test_on_cpu_the_weight_snapshots_in_host_memory_count() -> None:
    # On CPU host memory is the device: the trainer's snapshot of a version (2P) is on it instead of
    # two staging buckets, and a rollout role that feeds SGLang keeps two versions (4P) there, plus
    # the server's update bucket (2P).
    on_cpu = spec({"train": {"device": "cpu"}, "rollout": {"engine": "sglang"}})
    got = by_name(memory_estimate(on_cpu, TINY_QWEN3))
    assert got["trainer"].channel_buffers == 2 * P
    assert got["rollout engine"].channel_buffers == 4 * P + 2 * P and got["rollout engine"].engine_weights == 2 * P
