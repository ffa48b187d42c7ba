"""`RecordingBackend`: the in-memory `TrainBackend`, for tests of everything that drives a trainer.

Its "model" is one 2 x 2 weight that each training step raises by the number of rows trained,
so the weights tell how much was trained; it records every call in order (`calls`), checkpoints
through the real `CheckpointManager` (DCP files), and reports `optimizer_bytes` as moved by
`offload` the way a GPU trainer would, so the colocation order can be checked on a CPU.

    backend = RecordingBackend(optimizer_bytes=1024)
    backend.train_stream(batches); backend.offload(); backend.calls  # ["train_stream", "offload"]
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator

import torch

from relax_hpc.backends.batch import TrainBatch
from relax_hpc.ckpt import CheckpointManager, ResumeState
from relax_hpc.data.sample import Sample


class RecordingBackend:
    """A `TrainBackend` that records its calls; see the module docstring."""

    pad_id = 0
    sharded = False
    reads_rows = True

    def __init__(self, optimizer_bytes: int = 0) -> None:
        self.model = torch.nn.Linear(2, 2, bias=False)
        torch.nn.init.zeros_(self.model.weight)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.0)
        self.optimizer_bytes = optimizer_bytes
        self.calls: list[str] = []
        self.rows_trained = 0
        self.offloaded = False

    def _step(self, call: str, rows: int) -> dict[str, float]:
        if self.offloaded:
            raise RuntimeError(f"{call} while the optimizer state is offloaded: onload() first")
        self.calls.append(call)
        self.rows_trained += rows
        with torch.no_grad():
            self.model.weight += rows
        return {"loss": 0.0, "grad_norm": 0.0}

    def train(self, samples: list[Sample]) -> dict[str, float]:
        return self._step("train", len(samples))

    def train_batch(self, batch: TrainBatch | None) -> dict[str, float]:
        return self._step("train_batch", 0 if batch is None else len(batch))

    def train_stream(self, micro_batches: Iterable[TrainBatch]) -> dict[str, float]:
        rows = sum(len(batch) for batch in micro_batches)  # consumed first, as a trainer does
        return self._step("train_stream", rows)

    def compute_log_probs(self, samples: list[Sample], reference: bool = False) -> list[list[float]]:
        return [[0.0] * len(s.response_ids) for s in samples]

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield "weight", self.model.weight.detach()

    def save_checkpoint(self, manager: CheckpointManager, state: ResumeState) -> Path:
        self.calls.append("save_checkpoint")
        return manager.save(state.step, self.model, self.optimizer, state)

    def load_checkpoint(self, manager: CheckpointManager) -> ResumeState | None:
        self.calls.append("load_checkpoint")
        return manager.load_latest(self.model, self.optimizer)

    def offload(self) -> int:
        self.calls.append("offload")
        moved = 0 if self.offloaded else self.optimizer_bytes
        self.offloaded = True
        return moved

    def onload(self) -> None:
        self.calls.append("onload")
        self.offloaded = False
