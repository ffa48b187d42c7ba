"""What the trainer would refuse of a spec's model at start, said before the job runs.

The training backends refuse some models only once every rank has loaded them: FSDP2 over a
model whose blocks it cannot find (`fsdp_layout.fsdp2_refusal`), the Megatron backend on a
multimodal model (`megatron.refuse_multimodal`) or on a mixture-of-experts model on CPU
(`megatron_model.make_provider`, `MegatronBackend.named_weights`), on-policy distillation from a
multimodal teacher (`TorchBackend`). Each rule here mirrors one of those refusals and reads only
config.json, or `[model] arch` (`tiny_arch` for a model `build_tiny_if_missing` will write) where
the config is not readable here, so `relax-hpc validate`, `submit` and `run` refuse the spec at
once, naming the key. No torch: `validate` answers at once on a login node.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from relax_hpc.backends.fsdp_layout import fsdp2_refusal
from relax_hpc.media.families import FAMILIES
from relax_hpc.spec.errors import SpecError, SpecProblem, show_value
from relax_hpc.spec.model_fit import read_model_config, shape_from_config
from relax_hpc.spec.model_size import language_config
from relax_hpc.spec.schema import JobSpec

__all__ = ["ModelFacts", "backend_support_problems", "check_backend_support", "model_facts"]

# The model_type each `[model] arch` / `tiny_arch` name stands for (relax_hpc/models/tiny*.py).
ARCH_MODEL_TYPES = {"qwen3": "qwen3", "qwen3_tools": "qwen3", "qwen3_moe": "qwen3_moe", "qwen2_5_vl": "qwen2_5_vl",
                    "qwen3_vl": "qwen3_vl", "qwen2_5_omni": "qwen2_5_omni", "qwen3_omni": "qwen3_omni_moe"}
_MOE_ARCHS = frozenset({"qwen3_moe", "qwen3_omni"})
# Config keys only a multimodal model has (relax_hpc/models/hf.py refuses one outside FAMILIES).
_MULTIMODAL_KEYS = ("vision_config", "audio_config", "thinker_config")
# fsdp2_refusal names the key its reason is about; the problem report names it already.
_STRATEGY_PREFIX = '[train] strategy = "fsdp2" '


@dataclass(frozen=True)
class ModelFacts:
    """What the refusals need to know of a model; `source` says where it was learnt."""

    model_type: str
    multimodal: bool
    moe: bool
    source: str  # "config.json", "[model] arch" or "[model] tiny_arch"
    config: Mapping[str, Any]  # the config.json, or a stand-in holding only the arch's model_type


def _multimodal(config: Mapping[str, Any]) -> bool:
    return str(config.get("model_type") or "") in FAMILIES or any(key in config for key in _MULTIMODAL_KEYS)


def _experts(config: Mapping[str, Any]) -> int:
    text = language_config(config)
    return int(text.get("num_experts") or text.get("n_routed_experts") or text.get("num_local_experts") or 0)


def model_facts(spec: JobSpec, config: Mapping[str, Any] | None) -> ModelFacts | None:
    """The facts of the policy model: from its config.json, else from the arch the spec names; None
    when neither says (the refusals then wait for the run)."""
    if config is not None:
        return ModelFacts(str(config.get("model_type") or ""), _multimodal(config), _experts(config) > 0,
                          "config.json", config)
    arch, source = spec.model.arch, "[model] arch"
    if arch is None and spec.model.build_tiny_if_missing:
        arch, source = spec.model.tiny_arch, "[model] tiny_arch"
    if arch is None:
        return None
    model_type = ARCH_MODEL_TYPES[arch]
    return ModelFacts(model_type, model_type in FAMILIES, arch in _MOE_ARCHS, source, {"model_type": model_type})


def backend_support_problems(spec: JobSpec, config: Mapping[str, Any] | None,
                             teacher_config: Mapping[str, Any] | None = None,
                             critic_config: Mapping[str, Any] | None = None) -> list[SpecProblem]:
    """The spec's combinations with this model (and OPD teacher, and critic: `critic_config`,
    None for the policy's own) that the trainer or the critic would refuse at start."""
    facts = model_facts(spec, config)
    problems: list[SpecProblem] = []
    if facts is not None:
        problems += _strategy_problems(spec, facts)
        problems += _megatron_problems(spec, facts)
    critic_facts = model_facts(spec, critic_config) if critic_config is not None else facts
    if critic_facts is not None:
        problems += _critic_strategy_problems(spec, critic_facts)
        problems += _critic_megatron_problems(spec, critic_facts)
    if teacher_config is not None and spec.algorithm.name == "opd" and _multimodal(teacher_config):
        message = (f"is a multimodal model (model_type {teacher_config.get('model_type')}): on-policy distillation "
                   "takes a text-only teacher in this version (the trainer refuses it at start); use a text model "
                   "with the student's tokenizer as the teacher")
        problems.append(SpecProblem("algorithm.opd_teacher_path", show_value(spec.algorithm.opd_teacher_path),
                                    message))
    return problems


def _strategy_problems(spec: JobSpec, facts: ModelFacts) -> list[SpecProblem]:
    if spec.train.backend != "torch" or spec.train.strategy != "fsdp2":
        return []
    reason = fsdp2_refusal(facts.config)
    if reason is None:
        return []
    message = f"{reason.removeprefix(_STRATEGY_PREFIX)} (from {facts.source})"
    return [SpecProblem("train.strategy", show_value(spec.train.strategy), message)]


def _critic_strategy_problems(spec: JobSpec, facts: ModelFacts) -> list[SpecProblem]:
    """The critic's value model (roles/critic.py) under FSDP2: its backbone's decoder layers as units."""
    critic = spec.critic
    if critic is None or (critic.strategy or spec.train.strategy) != "fsdp2":
        return []
    inherited = "" if critic.strategy else ' (unset: it follows train.strategy = "fsdp2")'
    if facts.multimodal:
        message = (f"is fsdp2{inherited}, and {facts.model_type} (from {facts.source}) is multimodal: the critic "
                   "reads no media and shards the value model of text models only; set critic.strategy = \"ddp\"")
    else:
        reason = fsdp2_refusal(facts.config)
        if reason is None:
            return []
        message = (f"is fsdp2{inherited}: {reason.removeprefix(_STRATEGY_PREFIX)} (from {facts.source}); "
                   'set critic.strategy = "ddp"')
    return [SpecProblem("critic.strategy", show_value(critic.strategy or spec.train.strategy), message)]


def _critic_megatron_problems(spec: JobSpec, facts: ModelFacts) -> list[SpecProblem]:
    """The Megatron critic (megatron_value.py): a dense text model whose heads its TP size splits."""
    critic = spec.critic
    if critic is None or (critic.backend or spec.train.backend) != "megatron":
        return []
    backend = show_value(critic.backend or spec.train.backend)
    inherited = "" if critic.backend else ' (unset: it follows train.backend = "megatron")'
    if facts.multimodal or facts.moe:
        kind = "multimodal" if facts.multimodal else "a mixture-of-experts model"
        message = (f"is megatron{inherited}, and {facts.model_type} (from {facts.source}) is {kind}: the Megatron "
                   'critic builds dense text models only; set critic.backend = "torch"')
        return [SpecProblem("critic.backend", backend, message)]
    if facts.source != "config.json":
        return []
    try:
        shape = shape_from_config(facts.config)
    except (KeyError, TypeError, ValueError):
        return []  # model_fit reports a config it cannot read
    tp = (critic.megatron or spec.train.megatron).tensor_parallel
    if tp > 1 and (shape.heads % tp or (tp % shape.kv_heads and shape.kv_heads % tp)):
        message = (f"must divide the critic model's attention heads ({shape.heads}) and its key-value heads "
                   f"({shape.kv_heads}), or be a multiple of the latter (each rank holds whole heads)")
        return [SpecProblem("critic.megatron.tensor_parallel", show_value(tp), message)]
    return []


def _megatron_problems(spec: JobSpec, facts: ModelFacts) -> list[SpecProblem]:
    if spec.train.backend != "megatron":
        return []
    if facts.multimodal:
        message = (f"builds the language model only, and {facts.model_type} (from {facts.source}) is multimodal: "
                   'the Megatron backend has no vision or audio towers yet; set backend = "torch" '
                   '(strategy = "fsdp2" shards a large model)')
        return [SpecProblem("train.backend", show_value(spec.train.backend), message)]
    if facts.moe and spec.train.device == "cpu":
        message = (f"cannot train the mixture-of-experts {facts.model_type} (from {facts.source}) with "
                   'backend = "megatron": megatron-bridge converts experts to and from HF names only in '
                   "Transformer Engine's grouped-GEMM layout, which needs CUDA, so neither expert_parallel > 1 "
                   'nor the weight export to the engines works here; set device = "cuda" where Transformer '
                   'Engine is installed, or backend = "torch"')
        return [SpecProblem("train.device", show_value(spec.train.device), message)]
    return []


def _read(path: str, key: str, source: str) -> dict[str, Any] | None:
    try:
        return read_model_config(path, key=key)
    except ValueError as error:
        raise SpecError([SpecProblem(key, show_value(path), str(error))], source) from None


def check_backend_support(spec: JobSpec, source: str) -> None:
    """SpecError listing what the trainer would refuse of the spec's model at start."""
    config = _read(spec.model.path, "model.path", source)
    teacher_path = spec.algorithm.opd_teacher_path if spec.algorithm.name == "opd" else None
    teacher = _read(teacher_path, "algorithm.opd_teacher_path", source) if teacher_path else None
    critic_path = spec.critic.model_path if spec.critic is not None else None
    critic = _read(critic_path, "critic.model_path", source) if critic_path else None
    problems = backend_support_problems(spec, config, teacher, critic)
    if problems:
        raise SpecError(problems, source)
