"""Predicted bytes per GPU for each component of a job, from the spec and the model's config.json.

`memory_estimate(spec, config)` is a pure function: one `ComponentMemory` per component, its bytes
split by kind (parameters, gradients, optimizer state, weight-channel buffers, engine weights), so
a measurement of the tensors a role holds compares with it field by field. `memory_problems`
refuses a layout whose busiest GPU of a `[cluster.*]` component holds more than its
`gpu_memory_gb`; `memory_lines` is what `relax-hpc validate` prints. Activations, the KV cache and CUDA's own context come on top:
the check refuses what cannot fit even without them.

What each component holds, per GPU:

- trainer rank: its share of the parameters (all of them with `ddp`, 1/num_processes with `fsdp2`,
  1/(tensor_parallel * pipeline_parallel) with Megatron, experts also over expert_parallel).
  The torch backend keeps float32 parameters whatever `model.dtype` (compute is in `model.dtype`),
  with float32 gradients and AdamW's two float32 moments: 4 + 4 + 8 bytes per parameter. Megatron
  keeps parameters in `model.dtype`, float32 gradients (`grad_reduce_in_fp32`), and its optimizer
  a float32 master copy (for a 16-bit model) and the two moments, split over the data-parallel
  ranks with `distributed_optimizer`. Weights leave the trainer in buckets: two bucket-sized
  staging buffers on the GPU (relax_hpc/weights/channel.py), each at least the largest tensor;
  the version's snapshot is in host memory (on CPU, where that is the device, it is counted).
- reference (`kl_coef > 0` without a Reference role) and OPD teacher: frozen weights in
  `model.dtype`, sharded like the policy, on every trainer GPU.
- Reference / ActorFwd roles: a whole model each, on the forward component (else a trainer GPU);
  ActorFwd also keeps the next version's buffer.
- rollout engine: the weights in `model.dtype` (over `tp_size` GPUs for SGLang). A single native
  engine in the rollout process computes on the received buffer and keeps a spare one for the
  next version; otherwise the rollout role keeps two versions in host memory (counted on CPU) and
  passes them through two staging buckets on its GPU (and SGLang servers receive them in
  `update_bucket_mb` buckets).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from relax_hpc.spec.errors import SpecProblem, show_value
from relax_hpc.spec.model_size import ModelSize, model_size
from relax_hpc.spec.schema import JobSpec

__all__ = ["CHANNEL_BUCKET_BYTES", "ComponentMemory", "GB", "memory_estimate", "memory_lines", "memory_problems",
           "per_gpu_bytes"]

GB = 10**9  # gpu_memory_gb is in decimal gigabytes, as GPU vendors state them (an H100 80GB)
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# relax_hpc/weights/channel.py DEFAULT_BUCKET_BYTES (a test holds the two equal; importing it
# here would load torch into `relax-hpc validate`).
CHANNEL_BUCKET_BYTES = 512 << 20
_STAGING_BUFFERS = 2
_ENGINE = "rollout engine"


@dataclass(frozen=True)
class ComponentMemory:
    """Bytes one GPU of `cluster` holds for the component `name` (the busiest one: rank 0's)."""

    name: str  # "trainer", "reference", "teacher", "reference role", "actor_fwd", "rollout engine"
    cluster: str  # the [cluster.<cluster>] table whose GPUs hold it: "trainer", "rollout" or "forward"
    parameters: int = 0  # trained weights (the trainer's own copy) or frozen ones (reference, teacher)
    gradients: int = 0
    optimizer: int = 0  # optimizer state: moments, and Megatron's float32 master copy
    channel_buffers: int = 0  # weight-channel buffers: staging buckets, a spare version
    engine_weights: int = 0

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.channel_buffers + self.engine_weights


@dataclass(frozen=True)
class _Share:
    """The fraction of the model one trainer GPU holds, and of its optimizer state (Megatron's
    distributed optimizer splits that further, over the data-parallel ranks of each part)."""

    dense: float
    experts: float
    dense_optimizer: float = 1.0
    experts_optimizer: float = 1.0

    def of(self, size: ModelSize) -> float:
        return (size.parameters - size.experts) * self.dense + size.experts * self.experts

    def optimizer_of(self, size: ModelSize) -> float:
        return ((size.parameters - size.experts) * self.dense * self.dense_optimizer
                + size.experts * self.experts * self.experts_optimizer)


def _trainer_share(spec: JobSpec) -> _Share:
    processes = spec.train.num_processes
    if spec.train.backend == "megatron":
        mg = spec.train.megatron
        model_split = mg.tensor_parallel * mg.pipeline_parallel
        if not mg.distributed_optimizer:
            return _Share(1 / model_split, 1 / (model_split * mg.expert_parallel))
        # Dense parameters are replicated over num_processes / (TP * PP * CP) ranks; experts (their
        # tensor-parallel size is TP's) over num_processes / (TP * PP * EP).
        dense_dp = max(processes // (model_split * mg.context_parallel), 1)
        experts_dp = max(processes // (model_split * mg.expert_parallel), 1)
        return _Share(1 / model_split, 1 / (model_split * mg.expert_parallel), 1 / dense_dp, 1 / experts_dp)
    if spec.train.strategy == "fsdp2":
        return _Share(1 / processes, 1 / processes)
    return _Share(1.0, 1.0)


def _staging(size: ModelSize, weight_bytes: int, bucket_bytes: int = CHANNEL_BUCKET_BYTES) -> int:
    """Two staging buffers of one bucket, each at least the largest tensor, at most the whole model."""
    whole = size.parameters * weight_bytes
    return _STAGING_BUFFERS * min(max(bucket_bytes, size.largest_tensor * weight_bytes), whole)


def _sender_buffers(spec: JobSpec, size: ModelSize, weight_bytes: int) -> int:
    """The trainer's weight-channel bytes on its device: on a GPU the staging buckets (the snapshot
    is in host memory); on CPU, where host memory is the device, the snapshot itself."""
    if spec.train.device == "cpu":
        return size.parameters * weight_bytes
    return _staging(size, weight_bytes)


def _trainer(spec: JobSpec, size: ModelSize, share: _Share, weight_bytes: int) -> ComponentMemory:
    held = share.of(size)
    if spec.train.backend == "megatron":
        master = 4 if weight_bytes < 4 else 0
        return ComponentMemory("trainer", "trainer", parameters=round(held * weight_bytes), gradients=round(held * 4),
                               optimizer=round(share.optimizer_of(size) * (master + 8)),
                               channel_buffers=_sender_buffers(spec, size, weight_bytes))
    return ComponentMemory("trainer", "trainer", parameters=round(held * 4), gradients=round(held * 4),
                           optimizer=round(held * 8), channel_buffers=_sender_buffers(spec, size, weight_bytes))


def _engine(spec: JobSpec, size: ModelSize, weight_bytes: int) -> ComponentMemory:
    cluster = "trainer" if spec.cluster.colocate else "rollout"
    whole = size.parameters * weight_bytes
    if spec.rollout.engine == "native" and spec.rollout.num_engines == 1:
        # The engine computes on the received buffer; the spare one takes the next version.
        return ComponentMemory(_ENGINE, cluster, engine_weights=whole, channel_buffers=whole)
    # The rollout role keeps its two buffers in host memory: on CPU that is the device; on a GPU
    # each bucket passes through its staging buffers.
    received = 2 * whole if spec.train.device == "cpu" else _staging(size, weight_bytes)
    if spec.rollout.engine == "sglang":
        sglang = spec.rollout.sglang
        received += min(sglang.update_bucket_mb << 20, whole)  # what a server takes in one update
        return ComponentMemory(_ENGINE, cluster, engine_weights=-(-whole // sglang.tp_size), channel_buffers=received)
    return ComponentMemory(_ENGINE, cluster, engine_weights=whole, channel_buffers=received)


def memory_estimate(spec: JobSpec, config: Mapping[str, Any],
                    teacher_config: Mapping[str, Any] | None = None) -> tuple[ComponentMemory, ...]:
    """The bytes per GPU of each component of `spec` for the model `config` describes (a parsed
    config.json; `teacher_config`, the OPD teacher's, where readable). See the module docstring."""
    size = model_size(config)
    weight_bytes = _DTYPE_BYTES[spec.model.dtype]
    share = _trainer_share(spec)
    records = [_trainer(spec, size, share, weight_bytes)]
    if spec.algorithm.kl_coef > 0 and not spec.train.reference_role:
        records.append(ComponentMemory("reference", "trainer", parameters=round(share.of(size) * weight_bytes)))
    if spec.algorithm.name == "opd" and teacher_config is not None:
        teacher = model_size(teacher_config)
        records.append(ComponentMemory("teacher", "trainer", parameters=round(share.of(teacher) * weight_bytes)))
    forward = "forward" if spec.cluster.forward is not None else "trainer"
    whole = size.parameters * weight_bytes
    if spec.train.reference_role:
        records.append(ComponentMemory("reference role", forward, parameters=whole))
    if spec.train.actor_fwd_role:
        records.append(ComponentMemory("actor_fwd", forward, parameters=whole, channel_buffers=whole))
    records.append(_engine(spec, size, weight_bytes))
    return tuple(records)


def per_gpu_bytes(spec: JobSpec, records: tuple[ComponentMemory, ...]) -> dict[str, int]:
    """The bytes the busiest GPU of each [cluster.*] component holds. Colocated, the GPU holds the
    larger of two phases: training (engines released) and generation (the trainer's gradients and
    optimizer state offloaded, its parameters kept)."""
    totals: dict[str, int] = {}
    for record in records:
        if record.name != _ENGINE or not spec.cluster.colocate:
            totals[record.cluster] = totals.get(record.cluster, 0) + record.total
    if spec.cluster.colocate:
        engine = next(r for r in records if r.name == _ENGINE)
        trainer = next(r for r in records if r.name == "trainer")
        training = totals.get("trainer", 0)
        totals["trainer"] = max(training, training - trainer.gradients - trainer.optimizer + engine.total)
    return totals


def _advice(spec: JobSpec, cluster: str) -> str:
    train = spec.train
    if cluster == "forward":
        return ("the Reference / ActorFwd roles each hold a whole model on one GPU: use GPUs with more memory "
                "or set reference_role / actor_fwd_role = false")
    engine = (f"raise [rollout.sglang] tp_size (now {spec.rollout.sglang.tp_size}) to spread each engine's weights "
              "over more GPUs" if spec.rollout.engine == "sglang" else
              'the native engine holds the whole model on one GPU: use engine = "sglang" with a tp_size that splits it')
    if cluster == "rollout":
        return engine
    if train.backend == "megatron":
        advice = ("raise [train.megatron] tensor_parallel or pipeline_parallel (expert_parallel for a "
                  "mixture-of-experts model) or set distributed_optimizer = true, with num_processes and the "
                  "GPUs of [cluster.trainer] to match")
    elif train.strategy == "fsdp2":
        advice = (f"raise [train] num_processes (now {train.num_processes}) with the GPUs of [cluster.trainer]: "
                  "each rank holds 1/num_processes of the model")
    else:
        advice = ('set [train] strategy = "fsdp2" to shard parameters, gradients and optimizer state over the '
                  "num_processes ranks, and raise num_processes with the GPUs of [cluster.trainer]")
    return advice + (f"; or {engine}" if spec.cluster.colocate else "")


def memory_problems(spec: JobSpec, records: tuple[ComponentMemory, ...]) -> list[SpecProblem]:
    """Components whose predicted bytes exceed their GPUs' `gpu_memory_gb` (checked only for
    components with GPUs, and not with `train.device = "cpu"`, where nothing is on a GPU)."""
    if spec.train.device == "cpu":
        return []
    problems = []
    for cluster, total in per_gpu_bytes(spec, records).items():
        component = getattr(spec.cluster, cluster)
        if component is None or component.gpus_per_node == 0 or total <= component.gpu_memory_gb * GB:
            continue
        names = " + ".join(f"{r.name} {_gb(r.total)}" for r in records if r.cluster == cluster)
        message = (f"is below the ~{_gb(total)} predicted per GPU ({names}; activations and the KV cache come on "
                   f"top): {_advice(spec, cluster)}")
        problems.append(SpecProblem(f"cluster.{cluster}.gpu_memory_gb", show_value(component.gpu_memory_gb),
                                    message))
    return problems


def _gb(count: float) -> str:
    return f"{count / GB:.1f} GB" if count >= GB / 10 else f"{count / 2**20:.1f} MiB"


def _count(number: int) -> str:
    return f"{number / 1e9:.2f} B" if number >= 1e9 else f"{number / 1e6:.2f} M"


def memory_lines(spec: JobSpec, config: Mapping[str, Any],
                 teacher_config: Mapping[str, Any] | None = None) -> list[str]:
    """What `relax-hpc validate` prints: the parameter count, each component's predicted bytes
    per GPU by kind, and each component's busiest GPU against its gpu_memory_gb."""
    size = model_size(config)
    parts = [(name, count) for name, count in (("routed experts", size.experts), ("vision tower", size.vision),
                                               ("audio tower", size.audio)) if count]
    of_which = f" ({', '.join(f'{name} {_count(count)}' for name, count in parts)})" if parts else ""
    lines = [f"model: {_count(size.parameters)} parameters{of_which}; predicted per GPU (activations, KV cache "
             "and CUDA's context not counted):"]
    records = memory_estimate(spec, config, teacher_config)
    for record in records:
        kinds = [f"{f.name.replace('_', ' ')} {_gb(getattr(record, f.name))}" for f in fields(record)
                 if f.name not in ("name", "cluster") and getattr(record, f.name)]
        lines.append(f"  {record.name} (cluster.{record.cluster}): {_gb(record.total)} = " + " + ".join(kinds))
    for cluster, total in per_gpu_bytes(spec, records).items():
        component = getattr(spec.cluster, cluster)
        if component is not None and component.gpus_per_node and spec.train.device != "cpu":
            lines.append(f"  busiest GPU of cluster.{cluster}: {_gb(total)} of gpu_memory_gb = "
                         f"{component.gpu_memory_gb:g} GB")
    return lines
