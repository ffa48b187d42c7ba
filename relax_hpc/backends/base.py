"""The training backend interface: what the trainer role drives, whatever trains the model.

Implementations: `TorchBackend` (HF model, AdamW, ddp or fsdp2 over torch.distributed) and its
in-memory twin `backends/memory.py: RecordingBackend` (records calls, for tests); a
Megatron-core backend is to follow as one more module. `make_backend` builds the one
`[train] backend` names, inside the trainer rank's own process.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator, Protocol

import torch

from relax_hpc.backends.batch import TrainBatch
from relax_hpc.ckpt import CheckpointManager, ResumeState
from relax_hpc.data.sample import Sample

if TYPE_CHECKING:
    from relax_hpc.algos import LossConfig
    from relax_hpc.backends.parallel import Strategy
    from relax_hpc.backends.torch_backend import OptimConfig

BACKENDS: tuple[str, ...] = ("torch", "megatron")


class TrainBackend(Protocol):
    """One trainer rank's model and optimizer.

    A step is `train` (samples), `train_batch` (packed rows) or `train_stream` (packed
    micro-batches as they arrive); every rank calls it once per step, and its gradient is the
    whole step's (all micro-batches, all ranks). `named_weights` yields whole tensors with HF
    names for the weight channel and export (under sharding every rank must take part).
    `offload` moves the optimizer state off the device while engines share it (colocation) and
    returns the bytes it freed there; `onload` brings it back before the next step.
    """

    pad_id: int
    sharded: bool

    def train(self, samples: list[Sample]) -> dict[str, float]: ...

    def train_batch(self, batch: TrainBatch | None) -> dict[str, float]: ...

    def train_stream(self, micro_batches: Iterable[TrainBatch]) -> dict[str, float]: ...

    def compute_log_probs(self, samples: list[Sample], reference: bool = False) -> list[list[float]]: ...

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]: ...

    def save_checkpoint(self, manager: CheckpointManager, state: ResumeState) -> Path: ...

    def load_checkpoint(self, manager: CheckpointManager) -> ResumeState | None: ...

    def offload(self) -> int: ...

    def onload(self) -> None: ...


def require_backend(backend: str) -> None:
    """ValueError saying what to set when this version cannot run `[train] backend = backend`."""
    if backend == "megatron":
        raise ValueError(
            'train.backend = "megatron" is not available in this version of relax-hpc (only the torch '
            'backend is); set [train] backend = "torch"'
        )
    if backend != "torch":
        raise ValueError(f"train.backend = {backend!r}: allowed values are {', '.join(BACKENDS)}")


def make_backend(
    backend: str, model_path: str, optim: OptimConfig, loss: LossConfig, *, dtype: str, device: str,
    temperature: float, teacher_path: str | None, opd_coef: float, keep_reference: bool, strategy: Strategy,
) -> TrainBackend:
    """The backend `[train] backend` names; ValueError naming the allowed values otherwise."""
    require_backend(backend)
    from relax_hpc.backends.torch_backend import TorchBackend

    return TorchBackend(model_path, optim, loss, dtype=dtype, device=device, temperature=temperature,
                        teacher_path=teacher_path, opd_coef=opd_coef, keep_reference=keep_reference,
                        strategy=strategy)
