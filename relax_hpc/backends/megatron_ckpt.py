"""Checkpoints of the Megatron backend: megatron-core's dist_checkpointing inside CheckpointManager.

The model's ``sharded_state_dict()`` describes every local tensor as a piece of a global tensor
(its global shape, offset and which rank's copy is the main one); the optimizer's state mirrors
it (``megatron_optim``). ``dist_checkpointing.save`` with its default ``torch_dist`` backend
writes them as torch DCP files (``.metadata``, ``__<rank>_0.distcp``) plus ``common.pt`` and
``metadata.json``, and ``dist_checkpointing.load`` reads back whatever pieces the current layout
needs: a checkpoint written at TP=2 loads at TP=1, PP=2 at PP=1, and the reverse.

``CheckpointManager.save_with`` / ``load_latest_with`` wrap this in the project's layout
(``tmp_step_N`` renamed to ``step_N``, ``latest``, per-rank RNG states, resume.json, keep_last,
the owner-only and corrupt-file checks, fallback to an older checkpoint), as for the torch
backend. A torch-backend checkpoint has no ``metadata.json``; it is reported as written by
another backend rather than half-loaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from relax_hpc.backends.megatron_optim import TrainOptimizer
from relax_hpc.ckpt import CheckpointManager, Collective, ResumeState

BACKEND_KEY = "relax_hpc_backend"


def sharded_state(module: Any, optimizer: TrainOptimizer) -> dict[str, Any]:
    """The sharded state dict of model and optimizer (collective-free)."""
    model_state = module.sharded_state_dict()
    return {"model": model_state, **optimizer.sharded_state_dict(model_state), BACKEND_KEY: "megatron"}


def write_checkpoint(directory: Path, coll: Collective, module: Any, optimizer: TrainOptimizer) -> None:
    from megatron.core import dist_checkpointing

    del coll  # dist_checkpointing uses the default (world) group, as the manager does
    dist_checkpointing.save(sharded_state(module, optimizer), str(directory))


def read_checkpoint(directory: Path, coll: Collective, module: Any, optimizer: TrainOptimizer) -> None:
    from megatron.core import dist_checkpointing

    del coll
    if not (directory / "metadata.json").is_file():
        raise ValueError(
            f"{directory} has no metadata.json: it was not written by the megatron backend (a torch "
            '[train] backend checkpoint?); resume it with backend = "torch", or move it aside'
        )
    loaded = dist_checkpointing.load(sharded_state(module, optimizer), str(directory))
    if loaded.get(BACKEND_KEY) != "megatron":
        raise ValueError(f"{directory} was not written by the megatron backend")
    result = module.load_state_dict(loaded["model"], strict=False)
    # Megatron modules keep "_extra_state" entries (TE's fp8 metadata) that may be absent.
    missing = [k for k in (*result.missing_keys, *result.unexpected_keys) if not k.endswith("_extra_state")]
    if missing:
        raise ValueError(f"{directory} does not match the model: {', '.join(missing[:5])}")
    optimizer.load_state(loaded)


def save(manager: CheckpointManager, state: ResumeState, module: Any, optimizer: TrainOptimizer) -> Path:
    return manager.save_with(state.step, state, lambda d, c: write_checkpoint(d, c, module, optimizer))


def load(manager: CheckpointManager, module: Any, optimizer: TrainOptimizer) -> ResumeState | None:
    return manager.load_latest_with(lambda d, c: read_checkpoint(d, c, module, optimizer))
