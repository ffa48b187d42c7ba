"""How trainer ranks split the work: which device each rank uses, FSDP2 sharding, master weights.

`[train] strategy` picks one of two layouts of the trainer's data-parallel ranks:

* `ddp`: every rank holds the whole model and optimizer; gradients are summed with all-reduce
  (`TorchBackend._all_reduce_grads`).
* `fsdp2`: the model is cut into FSDP2 units (`fsdp_units`: each decoder layer of the language
  model, each media tower of a VL / omni model, then the root) and each unit is wrapped with
  `fully_shard` on a 1-D device mesh over the ranks, so parameters, gradients and optimizer
  state are split evenly; a unit's parameters are all-gathered for its forward and backward,
  and gradients are reduce-scattered (summed, like `ddp`'s all-reduce).

Master weights: whatever `[model] dtype` says, the trained parameters, their gradients and the
AdamW state are float32 (`keep_float32_masters`); the dtype is the compute dtype. Sharded,
FSDP2's `MixedPrecisionPolicy` all-gathers the parameters in it and reduces gradients in
float32, on CUDA (NCCL) and CPU (gloo) alike; one unsharded process computes under autocast
(`TorchBackend`). Weights leave the trainer in the dtype they were loaded in (`full_weights`).

Sharded parameters make every forward and backward a collective: all ranks must run as many
(`TorchBackend` pads the ranks with fewer micro-batches with empty passes), and every pass
must issue the same collectives in the same order on every rank, whatever media its rows
carry (`shard_model` explains how the towers ensure it).
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, get_args

import torch
import torch.distributed as dist
from torch import nn

from relax_hpc.spec.schema import TrainStrategy

if TYPE_CHECKING:  # FSDP loads when a model is sharded, not with this module
    from torch.distributed.fsdp import MixedPrecisionPolicy

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


_TOWERS = ("visual", "audio_tower")  # the media encoders' attribute names in the Qwen VL / omni models


@dataclass(frozen=True)
class FsdpUnits:
    """The modules `shard_model` wraps, with their attribute paths from the trained model."""

    layers: list[tuple[str, nn.Module]]  # the language model's decoder layers, in order
    towers: list[tuple[str, nn.Module]]  # media encoders (vision, audio), each one unit


def fsdp_units(model: nn.Module) -> FsdpUnits:
    """The FSDP2 units of an HF causal LM, VL model or omni thinker (the root takes the rest).

    The decoder layers live at `<base>.layers` for text models and at
    `<base>.language_model.layers` for the Qwen VL and omni families (`<base>` is the model's
    `base_model_prefix`, "model"); the towers at `<base>.visual` and `<base>.audio_tower`.
    `relax_hpc.backends.fsdp_layout` states the same from config.json, for `validate`.
    """
    prefix = getattr(model, "base_model_prefix", "model") or "model"
    base = getattr(model, prefix, None)
    candidates = [(f"{prefix}.layers", getattr(base, "layers", None)),
                  (f"{prefix}.language_model.layers", getattr(getattr(base, "language_model", None), "layers", None)),
                  ("layers", getattr(model, "layers", None))]
    found = [(path, layers) for path, layers in candidates if isinstance(layers, nn.ModuleList) and len(layers)]
    if not found:
        raise ValueError(
            f"[train] strategy = \"fsdp2\" wraps each decoder layer, but {type(model).__name__} has none "
            f"at {', '.join(path for path, _ in candidates)}; use strategy = \"ddp\" for this model"
        )
    path, layers = found[0]
    towers = [(f"{prefix}.{name}", tower) for name in _TOWERS
              if isinstance(tower := getattr(base, name, None), nn.Module) and any(True for _ in tower.parameters())]
    return FsdpUnits([(f"{path}.{i}", layer) for i, layer in enumerate(layers)], towers)


def keep_float32_masters(model: nn.Module) -> dict[str, torch.dtype]:
    """Cast `model`'s floating parameters to float32 in place (the master weights that AdamW
    steps); returns the dtype each state-dict tensor had, which is what engines were loaded in
    and what weights must leave in (`full_weights`, `TorchBackend.named_weights`).

    An AdamW step of lr 1e-6 on a bfloat16 weight is below half its ulp and rounds away; kept in
    float32, it does not. Buffers are left as they are (HF keeps rotary tables in float32).
    Tied parameters are one object, so they stay tied.
    """
    loaded = {name: tensor.dtype for name, tensor in model.state_dict().items()}
    for param in model.parameters():
        if param.is_floating_point() and param.dtype != torch.float32:
            param.data = param.data.float()
    return loaded


def mixed_precision(compute_dtype: torch.dtype, root: bool = False) -> MixedPrecisionPolicy:
    """FSDP2's policy for float32 masters computing in `compute_dtype`: parameters all-gathered
    in it, gradients reduce-scattered in float32; the root's output (the logits, whose log-probs
    make the loss) cast to float32. float32 compute: no casts at all."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if compute_dtype == torch.float32:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32,
                                output_dtype=torch.float32 if root else None)


def shard_model(model: nn.Module, device: torch.device, compute_dtype: torch.dtype = torch.float32) -> nn.Module:
    """Wrap each decoder layer, each media tower, then the root with FSDP2's `fully_shard` over
    all ranks (in place), computing in `compute_dtype` (from the policy's float32 masters, or a
    frozen model's own dtype).

    Gradients are summed over ranks rather than averaged: the loss is already divided by the
    whole step's token (or sequence) count, as with `ddp`.

    Media towers and ranks without media: the model calls a tower only for the images, videos or
    audio its rows carry, so a rank with a media-free micro-batch (or an empty padding pass)
    would skip the tower's all-gather and reduce-scatter while another rank waits in them. So
    every pass gathers every tower on every rank, in a fixed order, from a forward pre-hook of
    the root (after the root's own all-gather, before any layer's), and the towers keep their
    parameters unsharded until the pass ends (`reshard_after_forward=False`): the model's calls
    of a tower (none, one, or one each for images and videos) then issue no collective. In
    backward, a tower's inputs (pixel values, audio features) never require grad, so FSDP2
    reduces its gradients in its end-of-backward callback, on every rank, in the same order;
    `set_reduce_scatter_unused_params` makes a rank whose rows left a tower (or an MoE expert)
    without gradient reduce zeros for it instead of skipping the reduce-scatter. A pass without
    backward (log-probs) reshards the towers when the root's forward returns.

    A tower is one unit rather than one per block: it is gathered whole for the pass anyway, and
    it is small beside the language model (about 0.4-0.6 B parameters against 4-30 B).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    units = fsdp_units(model)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = mixed_precision(compute_dtype)
    for _, layer in units.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    towers = [tower for _, tower in units.towers]
    for tower in towers:
        fully_shard(tower, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, mp_policy=mixed_precision(compute_dtype, root=True))
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
            module.set_reduce_scatter_unused_params(True, recurse=False)
    if towers:
        _gather_towers_every_pass(model, towers)
    return model


def _gather_towers_every_pass(model: nn.Module, towers: list[nn.Module]) -> None:
    """The hooks `shard_model` describes: all-gather each tower at the start of every forward of
    the root, and reshard them at its end when no backward will."""

    def gather(module: nn.Module, args: Any, kwargs: Any) -> None:
        for tower in towers:
            tower.unshard()  # type: ignore[operator]  # an FSDPModule; a no-op when already gathered

    def release(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            for tower in towers:
                tower.reshard()  # type: ignore[operator]

    model.register_forward_pre_hook(gather, with_kwargs=True)
    model.register_forward_hook(release, with_kwargs=True)


def full_weights(model: nn.Module, dtypes: Mapping[str, torch.dtype] | None = None) -> list[tuple[str, torch.Tensor]]:
    """The whole model's state dict with HF names, gathered on CPU, each tensor cast to its dtype
    in `dtypes` (`keep_float32_masters`' record: what the engines hold). Collective: every rank
    must call it; rank 0 gets every tensor, the other ranks an empty list."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    out = []
    for name in list(state):
        tensor = state.pop(name)  # freed once cast: the peak stays the float32 state dict
        if isinstance(tensor, torch.Tensor):
            out.append((name, tensor if dtypes is None else tensor.to(dtypes.get(name, tensor.dtype))))
    return out


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


T = TypeVar("T")


def in_lockstep(items: Iterable[T], sum_over_ranks: Callable[[list[float]], list[float]]) -> Iterator[T | None]:
    """This rank's items, then None (ask for an empty pass) until every rank is through its own:
    with sharded parameters every forward and backward is a collective, so every rank must run
    as many. `sum_over_ranks` is the rank group's all-reduce of a few floats."""
    remaining = iter(items)
    while True:
        item = next(remaining, None)
        (busy,) = sum_over_ranks([0.0 if item is None else 1.0])
        if busy == 0:
            return
        yield item
