"""Build the trainer's models, so that under FSDP2 no rank holds a whole model on its device.

Unsharded (`ddp`, one process) a model is loaded whole onto the rank, as `load_policy_model`
does. Sharded (`strategy = "fsdp2"`), `load_sharded`:

1. every rank builds the model on the meta device (`empty_policy_model`: no storage), where the
   caller may change it first (`prepare`: the policy's float32 master weights);
2. shards it with the trainer's sharding function (`parallel.shard_model`) and materialises only
   its own shards on its device (`to_empty`);
3. rank 0 loads the checkpoint with `from_pretrained` into host memory (CPU, never the
   accelerator) and broadcasts it one tensor at a time; each rank keeps its slice of each
   (`set_model_state_dict(..., full_state_dict=True, broadcast_from_rank0=True)`), so a rank's
   device holds its shards plus the whole tensor in flight (one parameter, not the model);
4. the buffers that are not in a state dict (rotary ``inv_freq``, which `to_empty` leaves as
   garbage) and transformers' record of the weight-name conversions it applied are copied from
   rank 0's loaded model; then rank 0 frees it.

Why rank 0 runs `from_pretrained` rather than every rank reading its own slices from the
safetensors files: transformers 5 converts weights on load (MoE experts fused into 3-D tensors,
Qwen2.5-VL's ``model.*`` renamed ``model.language_model.*``, an omni thinker's ``thinker.``
prefix dropped), and re-implementing those conversions slice by slice would drift from theirs;
loading through transformers itself gives each parameter exactly the values `from_pretrained`
gives, at the price of one whole copy in rank 0's host memory while the model loads.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from relax_hpc.models.hf import empty_policy_model, load_policy_model

ModelFn = Callable[[nn.Module], Any]  # changes a model in place; what it returns is ignored


def load_model(path: str | Path, dtype: str, device: torch.device, shard: ModelFn | None,
               prepare: ModelFn | None = None) -> nn.Module:
    """The model at `path` on `device`: whole (`shard` None), or sharded by `shard` (e.g.
    `parallel.shard_model` bound to the device) without ever being whole on a rank's device
    (`load_sharded`). `prepare` runs on the model before it is sharded or filled (e.g. casting the
    parameters to float32 master weights): under FSDP2 it sees the meta-built model."""
    if shard is not None:
        return load_sharded(path, dtype, device, shard, prepare)
    model = load_policy_model(path, dtype=dtype, device=str(device))
    if prepare is not None:
        prepare(model)
    return model


def load_sharded(path: str | Path, dtype: str, device: torch.device, shard: ModelFn,
                 prepare: ModelFn | None = None) -> nn.Module:
    """The model at `path`, built on meta, prepared, sharded by `shard`, and filled from rank 0's
    copy. Collective: every rank of the default process group calls it with the same arguments."""
    source = load_policy_model(path, dtype=dtype, device="cpu") if dist.get_rank() == 0 else None
    model = empty_policy_model(path, dtype)
    _agree_on_layout(model, source, path)
    if prepare is not None:
        prepare(model)
    shard(model)
    model.to_empty(device=device)
    _fill_from_rank0(model, source)
    # Rank 0's host copy. An HF model holds reference cycles, so it would otherwise live until
    # the next garbage collection, beside the next model's copy (the reference follows the policy).
    del source
    gc.collect()
    return model


def _layout(model: nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()}


def _agree_on_layout(model: nn.Module, source: nn.Module | None, path: str | Path) -> None:
    """Raise on every rank when the meta-built model differs from what `from_pretrained` built
    (checked on rank 0, the verdict broadcast, so no rank waits for a collective that never comes)."""
    verdict: list[Any] = [None]
    if source is not None:
        built, loaded = _layout(model), _layout(source)
        differ = sorted(n for n in built.keys() | loaded.keys() if built.get(n) != loaded.get(n))
        verdict = [{"differ": differ, "conversions": getattr(source, "_weight_conversions", None)}]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0]["differ"]:
        names = ", ".join(verdict[0]["differ"][:5])
        raise RuntimeError(
            f"the model at {path}, built empty for sharded loading, differs from the one from_pretrained "
            f"loads ({len(verdict[0]['differ'])} tensors, e.g. {names}); train it with [train] strategy = "
            "\"ddp\", or report the model class"
        )
    # What transformers renamed and fused on load: checkpoint_state_dict and save_pretrained undo it.
    model._weight_conversions = verdict[0]["conversions"]  # type: ignore[assignment]


@torch.no_grad()
def _fill_from_rank0(model: nn.Module, source: nn.Module | None) -> None:
    """Copy rank 0's `source` into every rank's shards of `model`, tensor by tensor, then the
    buffers a state dict leaves out (they are whole on every rank: FSDP2 does not shard buffers)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    full = source.state_dict() if source is not None else {}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=True)
    set_model_state_dict(model, full, options=options)
    del full
    persistent = model.state_dict().keys()
    loaded = dict(source.named_buffers()) if source is not None else {}
    for name, buffer in model.named_buffers():
        if name in persistent:
            continue
        if source is not None:
            buffer.copy_(loaded[name])
        dist.broadcast(buffer, src=0)
