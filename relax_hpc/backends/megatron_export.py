"""HF export of a Megatron backend checkpoint, through megatron-bridge.

A checkpoint of ``[train] backend = "megatron"`` holds Megatron's tensors (fused QKV, the layout
of its tensor-parallel shards) in megatron-core's dist_checkpointing format
(``relax_hpc.backends.megatron_ckpt``). ``export_megatron_hf`` converts it in one process:

1. the Megatron model is built from the original HF directory as the backend builds it
   (``megatron_model.make_provider`` / ``build_model``) at TP = PP = 1, and the model part of the
   checkpoint is read into it (dist_checkpointing reshards whatever layout wrote it);
2. the bridge streams the weights out with HF names (``export_hf_weights``), each copied into the
   HF model built from the same directory (``load_policy_model``), so every HF tensor must be
   produced exactly once (no name is dropped or invented) and tied embeddings stay tied;
3. that model is saved as ``relax_hpc.ckpt.export.export_hf`` saves: ``save_pretrained`` plus the
   tokenizer files, via a temp directory and a rename.

Needs the Megatron environment (megatron-core 0.16.1, megatron-bridge 0.3.1, transformers < 5:
docs/backends.md "Megatron on CPU"); ``relax-hpc convert`` picks this for such a checkpoint.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from relax_hpc.backends.megatron_ckpt import BACKEND_KEY
from relax_hpc.ckpt.export import check_export_paths, copy_model_files, export_dtype_name, write_export_dir
from relax_hpc.ckpt.formats import checkpoint_backend

__all__ = ["export_megatron_hf"]

log = logging.getLogger(__name__)


def export_megatron_hf(
    checkpoint_dir: Path,
    model_dir: Path,
    out_dir: Path,
    *,
    overwrite: bool = False,
    dtype: torch.dtype | None = None,
    device: str = "cpu",
) -> Path:
    """Write an HF model directory at ``out_dir`` holding the weights of the Megatron checkpoint
    ``checkpoint_dir``; ``model_dir`` is the HF directory the run started from.

    ``dtype`` None keeps the dtype ``model_dir`` declares. ``device`` builds the Megatron model
    there ("cuda" where Transformer Engine is installed, which mixture-of-experts models need).
    Runs in a process without a process group, or in a one-rank one. Returns ``out_dir``.
    """
    from relax_hpc.backends.megatron import refuse_multimodal
    from relax_hpc.models.hf import load_policy_model

    checkpoint_dir, model_dir, out_dir = check_export_paths(checkpoint_dir, model_dir, out_dir, overwrite=overwrite)
    if checkpoint_backend(checkpoint_dir) != "megatron":
        raise ValueError(
            f"{checkpoint_dir} was written by the torch backend (HF names): export it with "
            "relax_hpc.ckpt.export.export_hf, which `relax-hpc convert` picks for it"
        )
    refuse_multimodal(model_dir)  # no such checkpoint can exist; the backend refuses to train one
    if dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError(
            f"export_megatron_hf converts in one process, but this one is rank {dist.get_rank()} of "
            f"{dist.get_world_size()}; run `relax-hpc convert` (or call it) outside the training job"
        )
    _require_bridge(checkpoint_dir)
    dtype_name = export_dtype_name(model_dir, dtype)
    started_group = not dist.is_initialized()
    try:
        megatron = _read_megatron_model(checkpoint_dir, model_dir, dtype_name, device)
        model = load_policy_model(model_dir, dtype=dtype_name)
        _copy_bridge_weights(megatron, model, checkpoint_dir)
    finally:
        _stop_parallel_state(started_group)

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp)
        copy_model_files(model_dir, tmp)

    write_export_dir(out_dir, write)
    log.info("exported the megatron checkpoint %s to %s", checkpoint_dir, out_dir)
    return out_dir


def _require_bridge(checkpoint_dir: Path) -> None:
    import importlib.util

    from relax_hpc.backends.megatron_model import INSTALL_HINT

    try:
        found = importlib.util.find_spec("megatron.bridge") is not None
    except ModuleNotFoundError:  # no megatron package at all
        found = False
    if not found:  # a ValueError: the command line prints it as one line, and it is the caller's to fix
        raise ValueError(
            f"{checkpoint_dir} is a megatron backend checkpoint, and converting it to HF needs megatron-core "
            f"and megatron-bridge, which this Python ({sys.executable}) lacks; {INSTALL_HINT}"
        )


def _read_megatron_model(checkpoint_dir: Path, model_dir: Path, dtype: str, device: str) -> Any:
    """The Megatron model of ``model_dir`` at TP = PP = 1 with the checkpoint's weights."""
    from relax_hpc.backends.megatron_model import build_model, make_provider, start_parallel_state
    from relax_hpc.spec.schema import MegatronSpec

    spec = MegatronSpec()  # one rank holds everything; dist_checkpointing reshards to it
    start_parallel_state(spec, device, seed=0)
    bridge, provider = make_provider(str(model_dir), spec, dtype=dtype, device=device)
    if provider.num_moe_experts and not provider.moe_grouped_gemm:
        raise ValueError(
            f"cannot convert {checkpoint_dir}: megatron-bridge 0.3.1 converts mixture-of-experts weights only in "
            "Transformer Engine's grouped-GEMM layout, which needs CUDA and Transformer Engine; run "
            "`relax-hpc convert JOB_DIR OUT --device cuda` on a GPU node of the Megatron environment"
        )
    built = build_model(bridge, provider, train=False, distributed_optimizer=False)
    _load_model_state(checkpoint_dir, built.module)
    return built


def _load_model_state(checkpoint_dir: Path, module: Any) -> None:
    """The model part of a dist_checkpointing directory into ``module`` (the optimizer's state,
    also in it, is left on disk)."""
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load({"model": module.sharded_state_dict()}, str(checkpoint_dir))
    if loaded.get(BACKEND_KEY) != "megatron":
        raise ValueError(
            f"{checkpoint_dir} is a dist_checkpointing directory that the megatron backend did not write "
            f"(its common.pt lacks {BACKEND_KEY}); export takes a step_<N> directory of a relax-hpc run"
        )
    result = module.load_state_dict(loaded["model"], strict=False)
    # "_extra_state" entries (Transformer Engine's fp8 metadata) may be absent on either side.
    mismatched = [k for k in (*result.missing_keys, *result.unexpected_keys) if not k.endswith("_extra_state")]
    if mismatched:
        raise ValueError(
            f"{checkpoint_dir} does not match the model built from the HF directory "
            f"(e.g. {', '.join(mismatched[:5])}); pass the [model] path the run trained"
        )


def _copy_bridge_weights(megatron: Any, model: torch.nn.Module, checkpoint_dir: Path) -> None:
    """Every HF tensor of ``model`` from the bridge's stream, each exactly once."""
    targets = model.state_dict()  # a tied output embedding appears under both names
    filled: set[str] = set()
    unknown: list[str] = []
    with torch.no_grad():
        for name, tensor in megatron.bridge.export_hf_weights([megatron.module], cpu=True, show_progress=False):
            target = targets.get(name)
            if target is None or target.shape != tensor.shape:
                unknown.append(f"{name} {tuple(tensor.shape)}")
                continue
            target.copy_(tensor)
            filled.add(name)
    tied = {name for name, t in targets.items() for other in filled if name not in filled
            and t.data_ptr() == targets[other].data_ptr()}
    missing = sorted(set(targets) - filled - tied)
    if unknown or missing:
        raise RuntimeError(
            f"converting {checkpoint_dir} through megatron-bridge did not give the HF model's tensors: "
            f"{len(missing)} missing (e.g. {missing[:3]}), {len(unknown)} not in the HF model or of another "
            f"shape (e.g. {unknown[:3]}); megatron-bridge 0.3.1 may not map this architecture"
        )


def _stop_parallel_state(started_group: bool) -> None:
    """Undo ``start_parallel_state``: Megatron's groups, and the one-rank process group it made."""
    try:
        from megatron.core import parallel_state
    except ImportError:
        return
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if started_group and dist.is_initialized():
        dist.destroy_process_group()
