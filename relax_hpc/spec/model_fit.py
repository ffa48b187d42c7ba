"""Does the model split the way the spec asks? Parallel sizes against the model's own shape.

The cross-checks (`cross_checks.py`) see only the spec; these also need the model's
``config.json``, so they run where the model directory is readable (`relax-hpc validate`,
`submit`, `run`) and say so when it is not. Megatron splits attention heads over
tensor-parallel ranks, layers over pipeline stages and experts over expert-parallel ranks;
SGLang splits heads over an engine's ``tp_size`` GPUs. A size that does not divide fails deep
inside the library after the job has waited in the queue; here it fails at once, naming the key.

`check_model_fit` also refuses a layout whose predicted bytes per GPU exceed the GPUs' memory
(`memory_estimate.py`). What the trainer would refuse of the model's kind (FSDP2 over a model it
cannot wrap, Megatron on a multimodal model) is checked by `relax_hpc.backends.spec_checks`, which
knows the backends' rules; this layer imports nothing above it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relax_hpc.spec.errors import SpecProblem, show_value
from relax_hpc.spec.memory_estimate import memory_estimate, memory_lines, memory_problems
from relax_hpc.spec.model_size import language_config
from relax_hpc.spec.schema import JobSpec

__all__ = ["ModelShape", "check_model_fit", "memory_report", "model_fit_problems", "read_model_config",
           "read_model_shape"]


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only HF model that parallel layouts must divide."""

    layers: int
    heads: int
    kv_heads: int
    hidden: int
    intermediate: int
    vocab: int
    experts: int = 0  # routed experts per MoE layer; 0 for a dense model
    expert_intermediate: int = 0
    tied_embeddings: bool = False
    head_dim: int = 0  # 0: hidden // heads


def shape_from_config(config: Mapping[str, Any]) -> ModelShape:
    """ModelShape from a parsed config.json; KeyError names a missing size."""
    text = language_config(config)
    heads = int(text["num_attention_heads"])
    return ModelShape(
        layers=int(text["num_hidden_layers"]), heads=heads,
        kv_heads=int(text.get("num_key_value_heads") or heads), hidden=int(text["hidden_size"]),
        intermediate=int(text.get("intermediate_size") or 0), vocab=int(text["vocab_size"]),
        experts=int(text.get("num_experts") or text.get("n_routed_experts") or 0),
        expert_intermediate=int(text.get("moe_intermediate_size") or 0),
        tied_embeddings=bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", False))),
        head_dim=int(text.get("head_dim") or 0),
    )


def read_model_config(model_dir: str | Path, key: str = "model.path") -> dict[str, Any] | None:
    """The parsed ``model_dir/config.json``; None when there is no such file to read here."""
    path = Path(model_dir).expanduser() / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return None
    except (OSError, ValueError) as error:
        raise ValueError(f"{path}: cannot read the model's config ({error}); check {key}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a model config (a JSON object); check {key}")
    return config


def _shape(config: Mapping[str, Any], path: Path) -> ModelShape:
    try:
        return shape_from_config(config)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as error:
        raise ValueError(f"{path}: not a decoder-only language model config (missing or bad {error}); "
                         "check model.path") from None


def read_model_shape(model_dir: str | Path) -> ModelShape | None:
    """The shape from ``model_dir/config.json``; None when there is no such file to read here."""
    config = read_model_config(model_dir)
    return None if config is None else _shape(config, Path(model_dir).expanduser() / "config.json")


def _must_divide(key: str, size: int, what: str, total: int) -> list[SpecProblem]:
    if size <= 1 or total % size == 0:
        return []
    return [SpecProblem(key, show_value(size), f"must divide the model's {what} ({total})")]


def _heads_split(key: str, size: int, shape: ModelShape) -> list[SpecProblem]:
    problems = _must_divide(key, size, "attention heads", shape.heads)
    if not problems and size > 1 and size % shape.kv_heads and shape.kv_heads % size:
        message = (f"must divide the model's key-value heads ({shape.kv_heads}) or be a multiple of them "
                   "(each rank needs whole key-value heads)")
        problems.append(SpecProblem(key, show_value(size), message))
    return problems


def model_fit_problems(spec: JobSpec, shape: ModelShape) -> list[SpecProblem]:
    """What in the spec's parallel layout the model cannot be split by."""
    problems: list[SpecProblem] = []
    if spec.train.backend == "megatron":
        mg = spec.train.megatron
        problems += _heads_split("train.megatron.tensor_parallel", mg.tensor_parallel, shape)
        problems += _must_divide("train.megatron.pipeline_parallel", mg.pipeline_parallel, "layers", shape.layers)
        if shape.experts:
            problems += _must_divide("train.megatron.expert_parallel", mg.expert_parallel, "experts", shape.experts)
            if mg.tensor_parallel > 1 and not mg.sequence_parallel:
                message = (f"must be true for a mixture-of-experts model with tensor_parallel = {mg.tensor_parallel}: "
                           "megatron-core refuses to train MoE layers under tensor parallelism without it")
                problems.append(SpecProblem("train.megatron.sequence_parallel", "false", message))
        elif mg.expert_parallel > 1:
            problems.append(SpecProblem("train.megatron.expert_parallel", show_value(mg.expert_parallel),
                                        "needs a mixture-of-experts model; this model is dense, set it to 1"))
    if spec.rollout.engine == "sglang":
        problems += _heads_split("rollout.sglang.tp_size", spec.rollout.sglang.tp_size, shape)
    if spec.algorithm.routing_replay and not shape.experts:
        problems.append(SpecProblem("algorithm.routing_replay", "true",
                                    "replays expert routing, but this model is dense; set routing_replay = false"))
    return problems


def check_model_fit(spec: JobSpec, source: str) -> ModelShape | None:
    """SpecError listing what the model cannot be split by and what cannot fit the GPUs; the shape,
    or None when the model's config.json is not readable here (the checks that need it then wait
    for `run`, where it must be)."""
    from relax_hpc.spec.errors import SpecError

    try:
        config = read_model_config(spec.model.path)
        shape = None if config is None else _shape(config, Path(spec.model.path).expanduser() / "config.json")
    except ValueError as error:
        raise SpecError([SpecProblem("model.path", show_value(spec.model.path), str(error))], source) from None
    if config is None or shape is None:
        return None
    problems = model_fit_problems(spec, shape)
    try:
        problems += memory_problems(spec, memory_estimate(spec, config, _teacher_config(spec, source)))
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as error:
        message = f"config.json lacks a size the memory estimate needs ({error}); check model.path"
        problems.append(SpecProblem("model.path", show_value(spec.model.path), message))
    if problems:
        raise SpecError(problems, source)
    return shape


def _teacher_config(spec: JobSpec, source: str) -> dict[str, Any] | None:
    """The OPD teacher's config.json where it is readable here."""
    from relax_hpc.spec.errors import SpecError

    path = spec.algorithm.opd_teacher_path
    if spec.algorithm.name != "opd" or path is None:
        return None
    try:
        return read_model_config(path, key="algorithm.opd_teacher_path")
    except ValueError as error:
        raise SpecError([SpecProblem("algorithm.opd_teacher_path", show_value(path), str(error))], source) from None


def memory_report(spec: JobSpec) -> list[str]:
    """What `relax-hpc validate` prints of the model's size and the predicted bytes per GPU; empty
    when the model's config.json is not readable here (call it after `check_model_fit`)."""
    config = read_model_config(spec.model.path)
    if config is None:
        return []
    teacher = _teacher_config(spec, "the job spec")
    lines = memory_lines(spec, config, teacher)
    if spec.algorithm.name == "opd" and teacher is None:
        lines.append(f"teacher {spec.algorithm.opd_teacher_path}: no config.json readable here; its bytes are "
                     "not counted")
    return lines
