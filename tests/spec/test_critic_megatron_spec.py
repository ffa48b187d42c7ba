"""`[critic] backend = "megatron"` and `[critic.megatron]`: what the spec resolves and what validate refuses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from model_configs import QWEN3_4B, QWEN3_VL_4B
from spec_example import spec_with

from relax_hpc.backends.spec_checks import backend_support_problems
from relax_hpc.roles.critic import critic_config
from relax_hpc.spec import SpecError, parse_spec

GAE = {"algorithm": {"advantage": "gae"}}


def refused(changes: dict[str, Any]) -> list[tuple[str, str | None, str]]:
    with pytest.raises(SpecError) as caught:
        parse_spec(spec_with(changes))
    return [(p.key, p.value, p.message) for p in caught.value.problems]


def test_an_unset_critic_backend_and_layout_follow_the_actors(tmp_path: Path) -> None:
    train = {"backend": "megatron", "num_processes": 2, "megatron": {"tensor_parallel": 2}}
    spec = parse_spec(spec_with({**GAE, "train": train, "critic": {"num_processes": 2}}))
    cfg = critic_config(spec, tmp_path, "cpu")
    assert cfg is not None and cfg.backend == "megatron" and cfg.megatron.tensor_parallel == 2
    # Its own keys win: a torch actor with a TP=2 Megatron critic, and the reverse.
    own = parse_spec(spec_with({**GAE, "critic": {"num_processes": 2, "backend": "megatron",
                                                  "megatron": {"tensor_parallel": 2}}}))
    cfg = critic_config(own, tmp_path, "cpu")
    assert cfg is not None and own.train.backend == "torch" and cfg.backend == "megatron"
    assert cfg.megatron.tensor_parallel == 2
    cfg = critic_config(parse_spec(spec_with({**GAE, "train": train, "critic": {"backend": "torch"}})), tmp_path, "cpu")
    assert cfg is not None and cfg.backend == "torch"


def test_a_megatron_critic_layout_it_cannot_split_is_refused() -> None:
    found = refused({**GAE, "critic": {"backend": "megatron", "num_processes": 3,
                                       "megatron": {"tensor_parallel": 2, "pipeline_parallel": 2,
                                                    "sequence_parallel": True}}})
    assert [(k, v) for k, v, _ in found] == [("critic.megatron.tensor_parallel", "2"),
                                              ("critic.megatron.pipeline_parallel", "2"),
                                              ("critic.megatron.sequence_parallel", "true")]
    assert "critic.num_processes = 3" in found[0][2] and "tensor parallelism only" in found[1][2]
    # Inherited from [train.megatron]: the message says where the size came from.
    ((key, _, message),) = refused({**GAE, "train": {"backend": "megatron", "num_processes": 2,
                                                     "megatron": {"tensor_parallel": 2}}, "critic": {}})
    assert key == "critic.megatron.tensor_parallel" and "takes [train.megatron]'s" in message
    ((key, _, message),) = refused({**GAE, "critic": {"megatron": {"tensor_parallel": 2}}})
    assert key == "critic.megatron" and 'not "torch"' in message


def test_a_megatron_critic_refuses_a_model_its_tensor_parallel_size_cannot_split() -> None:
    def problems(critic: dict[str, Any], config: dict[str, Any]) -> list[tuple[str, str]]:
        spec = parse_spec(spec_with({**GAE, "critic": {"backend": "megatron", **critic}}))
        return [(p.key, p.message) for p in backend_support_problems(spec, config)]

    tp = {"num_processes": 4, "megatron": {"tensor_parallel": 4}}
    assert problems(tp, QWEN3_4B) == []  # 32 heads, 8 key-value heads
    ((key, message),) = problems(tp, {**QWEN3_4B, "num_attention_heads": 6, "num_key_value_heads": 6})
    assert key == "critic.megatron.tensor_parallel" and "attention heads (6)" in message
    ((key, message),) = problems({}, QWEN3_VL_4B)
    assert key == "critic.backend" and "multimodal" in message and 'critic.backend = "torch"' in message
