"""Checkpoints: torch DCP save/load with tmp -> rename, a `latest` pointer, resume state and HF export.

    from relax_hpc.ckpt import CheckpointManager, ResumeState
    mgr = CheckpointManager(jobdir / "checkpoints", keep_last=2)
    state = mgr.load_latest(model, optimizer)      # None on a fresh start
    mgr.save(step, model, optimizer, ResumeState(step, version, cursor, samples))

See docs/checkpoints.md for the layout, resume and corruption behaviour, and docs/security.md
for the owner-only modes and the refusal to resume from a checkpoint others could change.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what type checkers see; at run time each name loads on first use (below)
    from relax_hpc.ckpt.collective import Collective, SingleProcessCollective, TorchDistCollective, default_collective
    from relax_hpc.ckpt.manager import CheckpointDiskFullError, CheckpointManager
    from relax_hpc.ckpt.permissions import UnsafeCheckpointError
    from relax_hpc.ckpt.resume_state import ResumeState, read_resume_file
    from relax_hpc.ckpt.rng import capture_rng_state, restore_rng_state

# The names below load on first use (PEP 562): `relax_hpc.ckpt.fs` (atomic writes) is imported by
# the command line, which must not pay for torch.distributed.checkpoint to print --help or render.
_WHERE = {
    "Collective": "collective",
    "SingleProcessCollective": "collective",
    "TorchDistCollective": "collective",
    "default_collective": "collective",
    "CheckpointDiskFullError": "manager",
    "CheckpointManager": "manager",
    "UnsafeCheckpointError": "permissions",
    "ResumeState": "resume_state",
    "read_resume_file": "resume_state",
    "capture_rng_state": "rng",
    "restore_rng_state": "rng",
}


def __getattr__(name: str) -> object:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'relax_hpc.ckpt' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"relax_hpc.ckpt.{module}"), name)
    globals()[name] = value
    return value


__all__ = sorted(_WHERE)
