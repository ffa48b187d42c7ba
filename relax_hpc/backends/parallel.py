"""How trainer ranks split the work: which device each rank uses, and FSDP2 sharding.

`[train] strategy` picks one of two layouts of the trainer's data-parallel ranks:

* `ddp`: every rank holds the whole model and optimizer; gradients are summed with all-reduce
  (`TorchBackend._all_reduce_grads`).
* `fsdp2`: every decoder layer, then the root module, is wrapped with `fully_shard` on a 1-D
  device mesh over the ranks, so parameters, gradients and optimizer state are split evenly;
  a layer's parameters are all-gathered for its forward and backward, and gradients are
  reduce-scattered (summed, like `ddp`'s all-reduce). On CUDA compute runs in bfloat16 with
  float32 gradient reduction; on CPU (gloo) there is no mixed precision.

Sharded parameters make every forward and backward a collective: all ranks must run as many
(`TorchBackend` pads the ranks with fewer micro-batches with empty passes).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import get_args

import torch
import torch.distributed as dist
from torch import nn

from relax_hpc.spec.schema import TrainStrategy

Strategy = TrainStrategy
STRATEGIES: tuple[Strategy, ...] = get_args(TrainStrategy)


def rank_device(requested: str, local_rank: int | None, env: Mapping[str, str] | None = None,
                ray_gpu_ids: Sequence[int | str] = ()) -> str:
    """The device of one trainer rank, so ranks sharing a node use different GPUs.

    `requested` is the spec's device ("cpu", "cuda", or an explicit "cuda:N", kept as is).
    For "cuda", in order: the first GPU Ray assigned to this process (`ray_gpu_ids`, located in
    `CUDA_VISIBLE_DEVICES`, which Ray restricts to them, so nothing else is visible); `LOCAL_RANK`
    from `env` (torchrun and similar launchers); else `local_rank`, this rank's position among
    the trainer ranks on its node. None of these means a single process: cuda:0.
    """
    if requested != "cuda":
        return requested
    env = os.environ if env is None else env
    if ray_gpu_ids:
        first = str(ray_gpu_ids[0])
        visible = [v.strip() for v in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        return f"cuda:{visible.index(first) if first in visible else int(first)}"
    if env.get("LOCAL_RANK", "").strip():
        return f"cuda:{int(env['LOCAL_RANK'])}"
    return f"cuda:{local_rank or 0}"


def ray_gpu_ids() -> list[int | str]:
    """The GPU ids Ray assigned to this process; empty outside Ray or without GPUs."""
    try:
        import ray

        if not ray.is_initialized():
            return []
        return list(ray.get_gpu_ids())
    except Exception:  # noqa: BLE001 - not under Ray
        return []


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of an HF causal LM (`model.model.layers` for Llama / Qwen families)."""
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    layers = getattr(base, "layers", None) or getattr(model, "layers", None)
    if layers is None:
        raise ValueError(
            f"[train] strategy = \"fsdp2\" wraps each decoder layer, but {type(model).__name__} has no "
            "model.layers; use strategy = \"ddp\" for this model"
        )
    return list(layers)


def shard_model(model: nn.Module, device: torch.device) -> nn.Module:
    """Wrap each decoder layer, then the root, with FSDP2's `fully_shard` over all ranks (in place).

    Gradients are summed over ranks rather than averaged: the loss is already divided by the
    whole step's token (or sequence) count, as with `ddp`.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    layer_policy = root_policy = MixedPrecisionPolicy()  # CPU: every tensor in its own dtype
    if device.type == "cuda":
        layer_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        # Logits leave the model in float32: the log-probs of the loss are taken from them.
        root_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                           output_dtype=torch.float32)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=layer_policy)
    fully_shard(model, mesh=mesh, mp_policy=root_policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    return model


def full_weights(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The whole model's state dict with HF names, gathered on CPU. Collective: every rank must
    call it; rank 0 gets every tensor, the other ranks an empty list."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return [(name, tensor) for name, tensor in get_model_state_dict(model, options=options).items()
            if isinstance(tensor, torch.Tensor)]


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)
