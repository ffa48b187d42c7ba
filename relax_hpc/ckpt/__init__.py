"""Checkpoints: torch DCP save/load with tmp -> rename, a `latest` pointer, resume state and HF export.

    from relax_hpc.ckpt import CheckpointManager, ResumeState
    mgr = CheckpointManager(jobdir / "checkpoints", keep_last=2)
    state = mgr.load_latest(model, optimizer)      # None on a fresh start
    mgr.save(step, model, optimizer, ResumeState(step, version, cursor, samples))

See docs/checkpoints.md for the layout, resume and corruption behaviour, and docs/security.md
for the owner-only modes and the refusal to resume from a checkpoint others could change.
"""

from relax_hpc.ckpt.collective import (
    Collective,
    SingleProcessCollective,
    TorchDistCollective,
    default_collective,
)
from relax_hpc.ckpt.manager import CheckpointDiskFullError, CheckpointManager
from relax_hpc.ckpt.permissions import UnsafeCheckpointError
from relax_hpc.ckpt.resume_state import ResumeState, read_resume_file
from relax_hpc.ckpt.rng import capture_rng_state, restore_rng_state

__all__ = [
    "CheckpointDiskFullError",
    "CheckpointManager",
    "Collective",
    "ResumeState",
    "SingleProcessCollective",
    "TorchDistCollective",
    "UnsafeCheckpointError",
    "capture_rng_state",
    "default_collective",
    "read_resume_file",
    "restore_rng_state",
]
