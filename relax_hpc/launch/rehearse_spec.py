"""The rehearsal of a job spec as a pure function: spec -> the spec a rehearsal runs, and every
change it made, each with its reason (`relax-hpc rehearse`; docs/rehearsal.md).

    rehearsal = rehearsal_spec(spec, Machine(device="cpu", steps=3, work_dir=Path("runs/rehearse-x")))
    print(format_changes(rehearsal.changes))

Nothing here reads or writes a file: what the machine offers (the model's config.json when it
is readable, whether the data file is, the SGLang and Megatron interpreters) comes in as
`Machine`, so the changes table of every shipped spec is a golden file
(tests/launch/golden/rehearse_*.txt). relax_hpc/launch/rehearse.py gathers those facts, builds
the tiny model and the synthetic rows, and runs the result.

What is kept: the architecture, the columns and media kinds, the reward, the engine kind, the
backend, the strategy and parallel layout (down to what this machine holds: >= 2 ranks for any
sharding, >= 2 engines for a router), the mode, colocation, staleness, algorithm, KL, reference
and agents. What changes is listed, row by row.
"""

from __future__ import annotations

import dataclasses
import math
import string
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from relax_hpc.spec import JobSpec, NotifySpec
from relax_hpc.spec.schema import ModelSpec

Device = Literal["cpu", "cuda"]

# The architectures a rehearsal can build a tiny model of ([model] arch; relax_hpc/models/tiny*.py).
TINY_ARCHS = ("qwen3", "qwen3_moe", "qwen2_5_vl", "qwen3_vl", "qwen2_5_omni", "qwen3_omni")
# config.json model_type -> the tiny architecture of that family.
ARCH_OF_MODEL_TYPE = {"qwen3": "qwen3", "qwen3_moe": "qwen3_moe", "qwen2_5_vl": "qwen2_5_vl",
                      "qwen3_vl": "qwen3_vl", "qwen2_5_omni": "qwen2_5_omni", "qwen3_omni_moe": "qwen3_omni"}
# The tiny text models of the qwen3 family that only `[model] tiny_arch` names: a rehearsal of a
# spec that builds one builds it too (tiny_tools.py: the tool call its agents learn is one token).
QWEN3_VARIANTS = ("qwen3_tools",)
# Positions of the tiny models: prompt plus response must fit (tiny*.py 256, tiny_mm.py 512).
TINY_POSITIONS = {"qwen3": 256, "qwen3_moe": 256, "qwen3_tools": 256}
TINY_MM_POSITIONS = 512

# What a rehearsal on this CPU machine shrinks to: the smallest sizes that run the same code paths.
MAX_SHARDS = 2  # trainer ranks of a sharded (or data-parallel) trainer; each model-parallel size
MAX_ENGINES = 2  # engines behind the router
SAMPLES_PER_PROMPT = 2  # a group needs two samples for its advantage
MAX_NEW_TOKENS = 8
MAX_TOTAL_TOKENS = 32  # an agent episode's response budget
DEFAULT_STEPS = 3
SYNTHETIC_DATA = "data/train.jsonl"  # under the rehearsal's directory
TINY_MODEL = "model"
JOB_DIR = "job"


@dataclass(frozen=True)
class Change:
    """One row of the changes table."""

    key: str  # a TOML key path, or a bracketed name for what is not a key ("[cluster.*]")
    production: str
    rehearsal: str
    why: str


@dataclass(frozen=True)
class Machine:
    """What the rehearsal runs on, as found by relax_hpc/launch/rehearse.py."""

    device: Device
    steps: int
    work_dir: Path  # absolute: the rehearsal's own directory (model/, data/, job/)
    model_config: Mapping[str, Any] | None = None  # the spec model's config.json, when readable here
    data_readable: bool = False
    arch: str | None = ModelSpec.arch  # --arch (none by default): wins over [model] arch and config.json
    sglang_python: str | None = None  # the SGLang environment's python, when the spec names none
    megatron_python: str | None = None  # the Megatron environment's python, when this one lacks it


@dataclass(frozen=True)
class Rehearsal:
    spec: JobSpec  # train.steps = Machine.steps; the resume run takes one more
    changes: list[Change]
    arch: str  # the tiny model to build at spec.model.path
    synthetic_kinds: tuple[str, ...] | None  # media kinds of the synthetic rows; None: the spec's data
    runner: str | None = None  # the interpreter that runs it; None: this one
    positions: int | None = None  # positions the tiny model must be given; None: its own suffice


def shown(value: object) -> str:
    """A value as the table shows it: TOML-like, "unset" for None."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return str(value)


def tiny_arch_of(spec: JobSpec, machine: Machine) -> tuple[str, str]:
    """The tiny architecture and where it came from: --arch, config.json, [model] arch, then the
    tiny_arch that build_tiny_if_missing would write (that one also where config.json is a qwen3
    the spec built: a QWEN3_VARIANTS tokenizer has tokens the plain tiny qwen3 lacks)."""
    if machine.arch is not None:
        return _known(machine.arch, "--arch"), "--arch"
    if machine.model_config is not None:
        model_type = str(machine.model_config.get("model_type", ""))
        if model_type not in ARCH_OF_MODEL_TYPE:
            raise ValueError(f"{spec.model.path}/config.json has model_type {model_type!r}, of which there is no "
                             f"tiny model; the families are {', '.join(sorted(ARCH_OF_MODEL_TYPE))} (pass --arch "
                             "to rehearse with one of them)")
        if model_type == "qwen3" and spec.model.build_tiny_if_missing and spec.model.tiny_arch in QWEN3_VARIANTS:
            return spec.model.tiny_arch, f"config.json model_type {model_type!r}, [model] tiny_arch"
        return ARCH_OF_MODEL_TYPE[model_type], f"config.json model_type {model_type!r}"
    if spec.model.arch is not None:
        return spec.model.arch, "[model] arch"
    if spec.model.build_tiny_if_missing:  # a tiny spec whose model is not built yet
        return spec.model.tiny_arch, "[model] tiny_arch"
    raise ValueError(f"model.path = {spec.model.path!r} has no config.json readable here and the spec sets no "
                     f"[model] arch: set arch (one of {', '.join(TINY_ARCHS)}) in [model], or pass --arch")


def _known(arch: str, where: str) -> str:
    if arch not in TINY_ARCHS:
        raise ValueError(f"{where} {arch!r}: no tiny model of it; choose one of {', '.join(TINY_ARCHS)}")
    return arch


def _text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The text tower's part of a (multimodal) config.json."""
    inner = config.get("thinker_config", config)
    return inner.get("text_config", inner) if isinstance(inner, Mapping) else config


def model_sizes(config: Mapping[str, Any] | None, arch: str) -> str:
    """The production sizes a tiny model replaces, as far as config.json tells them."""
    if config is None:
        return "config.json not readable here"
    text = _text_config(config)
    parts = [f"{text[key]} {name}" for key, name in (("num_hidden_layers", "layers"), ("hidden_size", "hidden"),
                                                       ("num_attention_heads", "heads"), ("num_experts", "experts"),
                                                       ("vocab_size", "vocab")) if key in text]
    return f"{arch}: " + ", ".join(parts) if parts else arch


def rehearsal_spec(spec: JobSpec, machine: Machine) -> Rehearsal:
    """The spec a rehearsal on `machine` runs, with every change made to it (pure)."""
    if machine.steps < 1:
        raise ValueError(f"--steps {machine.steps}: a rehearsal needs at least 1 step (default {DEFAULT_STEPS})")
    arch, arch_from = tiny_arch_of(spec, machine)
    changes: list[Change] = []
    work = machine.work_dir
    job = dataclasses.replace(spec.job, output_dir=str(work / JOB_DIR))
    changes.append(Change("job.output_dir", shown(spec.job.output_dir), shown(job.output_dir),
                          "the rehearsal's own job directory: checkpoints, logs and the export stay there"))
    model = dataclasses.replace(spec.model, path=str(work / TINY_MODEL), build_tiny_if_missing=False)
    changes.append(Change("model.path", f"{shown(spec.model.path)} ({model_sizes(machine.model_config, arch)})",
                          f"{shown(model.path)} (tiny {arch}: 2 layers, hidden 64)",
                          f"a tiny model of the same architecture ({arch_from}), written by the rehearsal"))
    data, kinds = _data(spec, machine, changes)
    cpu = machine.device == "cpu"
    rollout, algorithm, reward = spec.rollout, spec.algorithm, spec.reward
    if algorithm.name == "opd" and algorithm.opd_teacher_path is not None:
        algorithm = dataclasses.replace(algorithm, opd_teacher_path=model.path)
        changes.append(Change("algorithm.opd_teacher_path", shown(spec.algorithm.opd_teacher_path),
                              shown(model.path), "the teacher becomes the tiny model too (same architecture)"))
    if reward.genrm_model_path is not None:
        reward = dataclasses.replace(reward, genrm_model_path=model.path, genrm_tokenizer_path=None)
        changes.append(Change("reward.genrm_model_path", shown(spec.reward.genrm_model_path), shown(model.path),
                              "the judge becomes the tiny model (the same serving path)"))
    train = dataclasses.replace(spec.train, steps=machine.steps)
    changes.append(Change("train.steps", shown(spec.train.steps), f"{machine.steps}, then {machine.steps + 1}",
                          "--steps, then one more in a second run on the same job directory: the resume a "
                          "requeue does"))
    runner = None
    if cpu:
        train, rollout, data = _fit_cpu(spec, train, rollout, data, arch, changes)
    rollout = _sglang_python(spec, rollout, machine, changes)
    algorithm = _fit_overlong_buffer(spec, algorithm, rollout, changes)
    if spec.train.backend == "megatron" and machine.megatron_python is not None:
        runner = machine.megatron_python
        changes.append(Change("(interpreter)", "relax-hpc's", runner, "megatron-core and megatron-bridge live in "
                              "their own environment (docs/backends.md, \"Megatron on CPU\")"))
    checkpoint = spec.checkpoint
    if not checkpoint.resume:
        checkpoint = dataclasses.replace(checkpoint, resume=True)
        changes.append(Change("checkpoint.resume", "false", "true",
                              "the second run resumes from the first's checkpoint"))
    rehearsed = dataclasses.replace(spec, job=job, model=model, data=data, rollout=rollout, algorithm=algorithm,
                                    reward=reward, train=train, checkpoint=checkpoint,
                                    metrics=_metrics(spec, changes), notify=_notify(spec, changes),
                                    health=_health(spec, changes))
    _not_used(spec, changes)
    return Rehearsal(rehearsed, changes, arch, None if kinds is None else media_kinds(data), runner,
                     _positions(rehearsed, arch))


def tiny_positions(arch: str) -> int:
    return TINY_POSITIONS.get(arch, TINY_MM_POSITIONS)


def _positions(spec: JobSpec, arch: str) -> int | None:
    """With --device cuda the token budgets stay the spec's: the tiny model gets as many positions
    as a prompt and its response take (its rotary embeddings have no table to outgrow)."""
    needed = spec.data.max_prompt_tokens + max(spec.rollout.max_new_tokens, spec.rollout.max_total_tokens)
    return needed if needed > tiny_positions(arch) else None


def _data(spec: JobSpec, machine: Machine, changes: list[Change]) -> tuple[Any, tuple[str, ...] | None]:
    d = spec.data
    if machine.data_readable:
        return dataclasses.replace(d, path=str(Path(d.path).absolute())), None
    kinds = media_kinds(d)
    path = str(machine.work_dir / SYNTHETIC_DATA)
    columns = ", ".join(synthetic_columns(d))
    changes.append(Change("data.path", shown(d.path), shown(path),
                          f"not readable here: synthetic rows with the same columns ({columns}), labels in the "
                          f"shape reward {shown(spec.reward.function)} parses"))
    return dataclasses.replace(d, path=path, build_if_missing=None), kinds


def media_kinds(data: Any) -> tuple[str, ...]:
    """The media kinds [data] names a column for, in a fixed order."""
    keys = (("image", data.image_key), ("audio", data.audio_key), ("video", data.video_key))
    return tuple(kind for kind, key in keys if key)


def synthetic_columns(data: Any) -> list[str]:
    """The columns synthetic rows need: the prompt (or the template's fields), the label, the media."""
    fields = [name for _, name, _, _ in string.Formatter().parse(data.prompt_template or "") if name]
    media = [key for key in (data.image_key, data.audio_key, data.video_key) if key]
    return list(dict.fromkeys([data.prompt_key, *fields, data.label_key, *media]))


def _fit_cpu(spec: JobSpec, train: Any, rollout: Any, data: Any, arch: str,
             changes: list[Change]) -> tuple[Any, Any, Any]:
    """GPUs become CPU processes at the same layout, as small as still runs the same code paths."""
    t, r = spec.train, spec.rollout
    if t.device != "cpu":
        train = dataclasses.replace(train, device="cpu")
        changes.append(Change("train.device", shown(t.device), '"cpu"', "no GPU here: every rank is a CPU process "
                              "over gloo (--device cuda keeps it)"))
    train = _fit_ranks(spec, train, changes)
    engines = min(r.num_engines, MAX_ENGINES)
    samples = min(r.n_samples_per_prompt, SAMPLES_PER_PROMPT) if r.n_samples_per_prompt >= 2 else r.n_samples_per_prompt
    # Every rank gets a row of every mini-batch; the step's rows split evenly into mini-batches.
    want_rows = max(train.num_processes * t.mini_batches * t.micro_batch_size, 4)
    prompts = min(r.prompts_per_step, math.ceil(want_rows / samples))
    while (prompts * samples) % t.mini_batches and prompts < r.prompts_per_step:
        prompts += 1
    new_tokens = min(r.max_new_tokens, MAX_NEW_TOKENS)
    rollout = dataclasses.replace(rollout, num_engines=engines, n_samples_per_prompt=samples,
                                  prompts_per_step=prompts, max_new_tokens=new_tokens,
                                  max_total_tokens=min(r.max_total_tokens, MAX_TOTAL_TOKENS))
    _changed(changes, "rollout.num_engines", r.num_engines, engines,
             "2 CPU cores hold 2 engines: still a router over several engines")
    _changed(changes, "rollout.prompts_per_step", r.prompts_per_step, prompts,
             "enough rows for every trainer rank in every mini-batch, no more")
    _changed(changes, "rollout.n_samples_per_prompt", r.n_samples_per_prompt, samples,
             "the smallest group with an advantage")
    _changed(changes, "rollout.max_new_tokens", r.max_new_tokens, new_tokens, "a rehearsal of minutes, not hours")
    if r.env or r.generate or r.agent:
        _changed(changes, "rollout.max_total_tokens", r.max_total_tokens, rollout.max_total_tokens,
                 "a rehearsal of minutes, not hours")
    positions = tiny_positions(arch) - max(new_tokens, rollout.max_total_tokens)
    prompt_tokens = min(spec.data.max_prompt_tokens, positions)
    data = dataclasses.replace(data, max_prompt_tokens=prompt_tokens)
    _changed(changes, "data.max_prompt_tokens", spec.data.max_prompt_tokens, prompt_tokens,
             f"prompt and response fit the tiny model's {tiny_positions(arch)} positions")
    if r.on_sglang:
        if r.sglang.tp_size > 1:
            rollout = dataclasses.replace(rollout, sglang=dataclasses.replace(rollout.sglang, tp_size=1))
            _changed(changes, "rollout.sglang.tp_size", r.sglang.tp_size, 1,
                     "SGLang's CPU engine is one process per engine here (--tp-size > 1 splits over GPUs); "
                     "--device cuda keeps it")
        if data.video_key is not None:
            _changed(changes, "data.video_key", data.video_key, None, "SGLang on CPU cannot decode video (it "
                     "needs torchcodec or decord, neither runs there); the spec's other media kinds stay")
            data = dataclasses.replace(data, video_key=None)
    return train, rollout, data


def _fit_ranks(spec: JobSpec, train: Any, changes: list[Change]) -> Any:
    """The trainer's ranks: each model-parallel size at most 2, and data parallel what 2 ranks leave."""
    t, m = spec.train, spec.train.megatron
    if t.backend != "megatron":
        ranks = min(t.num_processes, MAX_SHARDS)
        _changed(changes, "train.num_processes", t.num_processes, ranks,
                 f"2 CPU cores: the smallest {t.strategy} over several ranks (same collectives, same sharding)")
        return dataclasses.replace(train, num_processes=ranks)
    sizes = {"tensor_parallel": m.tensor_parallel, "pipeline_parallel": m.pipeline_parallel,
             "context_parallel": m.context_parallel, "expert_parallel": m.expert_parallel}
    kept = {key: min(size, MAX_SHARDS) for key, size in sizes.items()}
    for key, size in sizes.items():
        _changed(changes, f"train.megatron.{key}", size, kept[key], "2 CPU cores: the smallest split of this kind")
    data_parallel = t.num_processes // (m.tensor_parallel * m.pipeline_parallel * m.context_parallel)
    model_parallel = kept["tensor_parallel"] * kept["pipeline_parallel"] * kept["context_parallel"]
    # The model-parallel split first (it decides how the weights are cut), then what is left of
    # MAX_SHARDS for data parallelism; expert-parallel ranks come out of the data-parallel ones.
    dp = max(min(data_parallel, MAX_SHARDS // model_parallel), kept["expert_parallel"], 1)
    ranks = model_parallel * dp
    _changed(changes, "train.num_processes", t.num_processes, ranks,
             f"2 CPU cores: data parallel {data_parallel} -> {dp} at the model-parallel split below")
    megatron = dataclasses.replace(m, **kept)
    if m.distributed_optimizer:
        megatron = dataclasses.replace(megatron, distributed_optimizer=False)
        _changed(changes, "train.megatron.distributed_optimizer", True, False,
                 "needs CUDA; on CPU Megatron trains with torch's AdamW (--device cuda keeps it)")
    return dataclasses.replace(train, num_processes=ranks, megatron=megatron)


def _fit_overlong_buffer(spec: JobSpec, algorithm: Any, rollout: Any, changes: list[Change]) -> Any:
    """DAPO's soft overlong buffer keeps its share of max_new_tokens when the rehearsal shortens them."""
    buffer, before, after = algorithm.overlong_buffer_len, spec.rollout.max_new_tokens, rollout.max_new_tokens
    if buffer == 0 or after == before:
        return algorithm
    scaled = min(after, max(1, round(buffer * after / before)))
    _changed(changes, "algorithm.overlong_buffer_len", buffer, scaled,
             f"the same share of the shorter max_new_tokens ({after}): the penalty still falls over the last tokens")
    return dataclasses.replace(algorithm, overlong_buffer_len=scaled)


def _sglang_python(spec: JobSpec, rollout: Any, machine: Machine, changes: list[Change]) -> Any:
    if not spec.rollout.on_sglang or spec.rollout.sglang.python is not None or machine.sglang_python is None:
        return rollout
    _changed(changes, "rollout.sglang.python", None, machine.sglang_python,
             "SGLang pins its own torch: its servers run from their own environment (RELAX_SGLANG_ENV, else "
             ".venv-sglang; docs/engines.md, \"SGLang on CPU\")")
    return dataclasses.replace(rollout, sglang=dataclasses.replace(rollout.sglang, python=machine.sglang_python))


def _metrics(spec: JobSpec, changes: list[Change]) -> Any:
    m = spec.metrics
    for key, value in (("wandb_project", m.wandb_project), ("clearml_project", m.clearml_project),
                       ("mlflow_experiment", m.mlflow_experiment)):
        _changed(changes, f"metrics.{key}", value, None, "a rehearsal's numbers are not the run's: no tracker")
    return dataclasses.replace(m, wandb_project=None, clearml_project=None, mlflow_experiment=None)


def _notify(spec: JobSpec, changes: list[Change]) -> NotifySpec:
    n = spec.notify
    if n.urls or n.urls_file:
        changes.append(Change("notify.urls", "set", "unset", "a rehearsal pages nobody"))
    return NotifySpec()


def _health(spec: JobSpec, changes: list[Change]) -> Any:
    h = spec.health
    _changed(changes, "health.max_global_restarts", h.max_global_restarts, 0,
             "the first failure ends the rehearsal and is reported with its role (a restart would repeat it)")
    return dataclasses.replace(h, max_global_restarts=0)


def _not_used(spec: JobSpec, changes: list[Change]) -> None:
    """What `relax-hpc run` does not read: the Slurm layout and the container."""
    c = spec.cluster
    parts = [f"{name} {comp.nodes} node(s) x {comp.gpus_per_node} GPUs"
             for name, comp in (("trainer", c.trainer), ("rollout", c.rollout), ("forward", c.forward))
             if comp is not None and comp.gpus_per_node]
    if parts:
        changes.append(Change("[cluster.*]", "; ".join(parts), "this machine, not submitted",
                              "relax-hpc run runs the spec here with a local Ray cluster and never reads the "
                              "Slurm tables (render and submit do); the parallel layout above is kept"))
    if spec.container.image is not None:
        changes.append(Change("container.image", shown(spec.container.image), "not used",
                              "relax-hpc run runs on the host; the image wraps the Slurm steps of submit"))


def _changed(changes: list[Change], key: str, before: object, after: object, why: str) -> None:
    if before != after:
        changes.append(Change(key, shown(before), shown(after), why))


def format_changes(changes: list[Change]) -> str:
    """The table: key, production value, rehearsal value, why; one row a change."""
    head = ("key", "production", "rehearsal", "why")
    rows = [head, *((c.key, c.production, c.rehearsal, c.why) for c in changes)]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row[:3], widths)) + "  " + row[3] for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths) + "  " + "-" * 3)
    return "\n".join(line.rstrip() for line in lines)
