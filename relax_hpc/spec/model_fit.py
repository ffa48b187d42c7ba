"""Does the model split the way the spec asks? Parallel sizes against the model's own shape.

The cross-checks (`cross_checks.py`) see only the spec; these also need the model's
``config.json``, so they run where the model directory is readable (`relax-hpc validate`,
`submit`, `run`) and say so when it is not. Megatron splits attention heads over
tensor-parallel ranks, layers over pipeline stages and experts over expert-parallel ranks;
SGLang splits heads over an engine's ``tp_size`` GPUs. A size that does not divide fails deep
inside the library after the job has waited in the queue; here it fails at once, naming the key.

`memory_estimate` gives the weights, gradients and optimizer state per trainer GPU and the
weights per engine GPU (activations and KV cache excluded), for `validate` to print.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relax_hpc.spec.errors import SpecProblem, show_value
from relax_hpc.spec.schema import JobSpec

__all__ = ["ModelShape", "memory_estimate", "model_fit_problems", "read_model_shape"]

_GIB = 1024**3
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Mixed-precision Adam per parameter beyond the weights: float32 gradient, master copy, two moments.
_TRAIN_STATE_BYTES = 4 + 4 + 4 + 4


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

    @property
    def expert_parameters(self) -> int:
        """The routed experts' share of `parameters` (what expert parallelism splits)."""
        return self.layers * self.experts * 3 * self.hidden * self.expert_intermediate

    @property
    def parameters(self) -> int:
        """Approximate parameter count (attention, MLP or experts, embeddings; norms ignored)."""
        head_dim = self.head_dim or self.hidden // self.heads
        attention = self.hidden * head_dim * (2 * self.heads + 2 * self.kv_heads)
        if self.experts:
            mlp = self.experts * 3 * self.hidden * self.expert_intermediate + self.hidden * self.experts
        else:
            mlp = 3 * self.hidden * self.intermediate
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return self.layers * (attention + mlp) + embeddings


def _text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's config: top level, or nested in multimodal configs."""
    for path in (("thinker_config", "text_config"), ("text_config",), ("llm_config",)):
        node: Any = config
        for key in path:
            node = node.get(key) if isinstance(node, Mapping) else None
        if isinstance(node, Mapping) and "num_hidden_layers" in node:
            return node
    return config


def shape_from_config(config: Mapping[str, Any]) -> ModelShape:
    """ModelShape from a parsed config.json; KeyError names a missing size."""
    text = _text_config(config)
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


def read_model_shape(model_dir: str | Path) -> ModelShape | None:
    """The shape from ``model_dir/config.json``; None when there is no such file to read here."""
    path = Path(model_dir).expanduser() / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return None
    except (OSError, ValueError) as error:
        raise ValueError(f"{path}: cannot read the model's config ({error}); check model.path") from None
    try:
        return shape_from_config(config)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as error:
        raise ValueError(f"{path}: not a decoder-only language model config (missing or bad {error}); "
                         "check model.path") from None


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


def memory_estimate(spec: JobSpec, shape: ModelShape) -> dict[str, float]:
    """GiB per GPU: trainer weights + gradients + Adam state, and an engine's weights.

    With the distributed optimizer the Adam part is split over the data-parallel ranks (for the
    experts, Megatron splits it over their own data-parallel group; taken as the same here)."""
    params = shape.parameters
    weight_bytes = _DTYPE_BYTES[spec.model.dtype]
    model_split = 1
    optimizer_split = 1
    per_rank = float(params)
    if spec.train.backend == "megatron":
        mg = spec.train.megatron
        model_split = mg.tensor_parallel * mg.pipeline_parallel
        data_parallel = max(spec.train.num_processes // (model_split * mg.context_parallel), 1)
        optimizer_split = data_parallel if mg.distributed_optimizer else 1
        # Experts are split over expert_parallel ranks too (their tensor-parallel size is TP's).
        per_rank = (params - shape.expert_parameters) / model_split + \
            shape.expert_parameters / (model_split * mg.expert_parallel)
    elif spec.train.strategy == "fsdp2":
        per_rank = params / spec.train.num_processes
    trainer = per_rank * (weight_bytes + _TRAIN_STATE_BYTES / optimizer_split)
    engine_split = spec.rollout.sglang.tp_size if spec.rollout.engine == "sglang" else 1
    return {"parameters_billion": params / 1e9, "trainer_gib_per_gpu": trainer / _GIB,
            "engine_weights_gib_per_gpu": params * weight_bytes / engine_split / _GIB}


def check_model_fit(spec: JobSpec, source: str) -> ModelShape | None:
    """SpecError listing what the model cannot be split by; the shape, or None when the model's
    config.json is not readable here (the checks then wait for `run`, where it must be)."""
    from relax_hpc.spec.errors import SpecError

    try:
        shape = read_model_shape(spec.model.path)
    except ValueError as error:
        raise SpecError([SpecProblem("model.path", show_value(spec.model.path), str(error))], source) from None
    if shape is None:
        return None
    problems = model_fit_problems(spec, shape)
    if problems:
        raise SpecError(problems, source)
    return shape
