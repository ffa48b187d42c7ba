"""What a role holds, in bytes, counted from the tensors it owns (not the process's RSS).

Each role answers `memory_record()` with a `MemoryRecord`: its parameters, gradients, optimizer
state, reference/teacher copies, weight-channel buffers and engine weights, each the bytes of
*this process's* tensors (an FSDP2 parameter counts its local shard), and `model_bytes`, the
whole model's parameter bytes, so a reader can say what share of the model a rank holds.
Tensors that share storage (tied embeddings, an engine's parameters bound to the inbox's flat
buffer) are counted once, under the first category that names them.

Categories are split by where they are meant to live: `on_device` is what sits on the role's
compute device (the GPU on a GPU node), `in_host_memory` what the role keeps in host memory by
design (the weight snapshot, rank 0's gathered copy of sharded weights, a rollout role's buffers
for SGLang engines). On a CPU run both are the same memory; the split then says what each tensor
is for, which is what the rehearsal checks (docs/rehearsal.md). The driver writes every role's
record into summary.json ("memory") and status.json at the end of a run; `relax-hpc status`
shows them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch


@dataclass
class MemoryRecord:
    role: str  # "trainer", "rollout", "engine"
    rank: int
    device: str
    model_bytes: int = 0  # the whole model's parameters (global shapes), for shares
    on_device: dict[str, int] = field(default_factory=dict)
    in_host_memory: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def device_total(self) -> int:
        return sum(self.on_device.values())


class StorageCounter:
    """Sums tensor bytes, each storage once: a second tensor on a storage already counted adds 0."""

    def __init__(self) -> None:
        self._seen: set[tuple[str, int]] = set()

    def bytes_of(self, tensors: Iterable[torch.Tensor | None]) -> int:
        total = 0
        for tensor in tensors:
            local = local_tensor(tensor)
            if local is None or local.device.type == "meta" or local.numel() == 0:
                continue
            storage = local.untyped_storage()
            key = (str(local.device), storage.data_ptr())
            if key in self._seen:
                continue
            self._seen.add(key)
            total += storage.nbytes()
        return total


def local_tensor(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """The part of `tensor` this process holds: a DTensor's local shard, else the tensor."""
    if tensor is None:
        return None
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def global_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the tensors at their full (unsharded) shapes: a DTensor counts all its shards."""
    return sum(t.numel() * t.element_size() for t in tensors)


def optimizer_tensors(optimizer: Any) -> list[torch.Tensor]:
    """The tensors of a torch optimizer's state (AdamW's moments and steps); none for other kinds."""
    state = getattr(optimizer, "state", None)
    if not isinstance(state, dict):
        return []
    return [value for per_param in list(state.values()) if isinstance(per_param, dict)
            for value in list(per_param.values()) if isinstance(value, torch.Tensor)]


def module_tensors(module: torch.nn.Module | None) -> list[torch.Tensor]:
    if module is None:
        return []
    return [*module.parameters(), *module.buffers()]


def trainer_record(backend: Any, rank: int, host_copies: dict[str, Iterable[torch.Tensor]],
                   channel_bytes: int = 0) -> MemoryRecord:
    """A trainer rank's record from its backend and what the role keeps besides: `host_copies` by
    name, and the weight channel's staging buffers on the device. A backend that answers
    `memory_tensors()` (the Megatron backend: model chunks, gradient buffer, masters) names its
    tensors by kind; otherwise they are read from its `model`, `optimizer`, `reference` and
    `teacher` (what a backend lacks counts 0)."""
    parts = backend.memory_tensors() if callable(getattr(backend, "memory_tensors", None)) else _torch_parts(backend)
    parameters = parts.get("parameters", [])
    model_bytes = getattr(backend, "model_bytes", None)  # a backend whose parameters are plain shards says
    count = StorageCounter()
    record = MemoryRecord("trainer", rank, str(getattr(backend, "device", "cpu")),
                          model_bytes=int(model_bytes) if model_bytes is not None else global_bytes(parameters))
    record.on_device = {
        "parameters": count.bytes_of(parameters),
        "gradients": count.bytes_of(parts.get("gradients", [])),
        "masters": count.bytes_of(parts.get("masters", [])),
        "optimizer": count.bytes_of(parts.get("optimizer", [])),
        "reference": count.bytes_of(parts.get("reference", [])),
        "teacher": count.bytes_of(parts.get("teacher", [])),
        "channel_buffers": channel_bytes,
    }
    record.in_host_memory = {name: count.bytes_of(tensors) for name, tensors in host_copies.items()}
    return record


def _torch_parts(backend: Any) -> dict[str, list[torch.Tensor | None]]:
    """The torch backend's tensors: its parameters are the float32 masters (keep_float32_masters)."""
    model = getattr(backend, "model", None)
    parameters = list(model.parameters()) if isinstance(model, torch.nn.Module) else []
    return {
        "parameters": parameters,
        "gradients": [local_tensor(p.grad) for p in parameters],
        "optimizer": list(optimizer_tensors(getattr(backend, "optimizer", None))),
        "reference": module_tensors(getattr(backend, "reference", None)),
        "teacher": module_tensors(getattr(backend, "teacher", None)),
    }


def rollout_record(engine_modules: Iterable[torch.nn.Module], buffers: Iterable[torch.Tensor], device: str,
                   buffers_on_device: bool, channel_bytes: int = 0) -> MemoryRecord:
    """The rollout role's record: the weights of the engines in this process (`engine_modules`;
    SGLang servers and engine actors hold theirs in processes of their own), and the inbox's
    flat `buffers`, on the device or in host memory (`weight_home`). An engine bound to a buffer
    shares its storage: counted once, as engine weights."""
    count = StorageCounter()
    modules = list(engine_modules)
    record = MemoryRecord("rollout", 0, device,
                          model_bytes=max((global_bytes(m.parameters()) for m in modules), default=0))
    engines = count.bytes_of(t for m in modules for t in module_tensors(m))
    held = count.bytes_of(buffers)
    record.on_device = {"engine_weights": engines, "channel_buffers": (held if buffers_on_device else 0) + channel_bytes}
    record.in_host_memory = {"weight_buffers": 0 if buffers_on_device else held}
    return record


def engine_record(model: torch.nn.Module | None, index: int, device: str) -> MemoryRecord:
    """An engine actor's record: the weights of the model it serves."""
    tensors = module_tensors(model)
    record = MemoryRecord("engine", index, device, model_bytes=global_bytes(model.parameters()) if model else 0)
    record.on_device = {"engine_weights": StorageCounter().bytes_of(tensors)}
    return record
