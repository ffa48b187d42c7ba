"""The Actor role: one trainer process wrapping a training backend.

With `world_size > 1` each process joins a torch.distributed group (gloo on CPU, NCCL on GPU)
through a TCP store on rank 0's host, trains on its shard of every batch, and checkpoints
collectively. A plain class; the driver places one Ray actor per rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from relax_hpc.algos import LossConfig
from relax_hpc.backends.torch_backend import OptimConfig, TorchBackend
from relax_hpc.ckpt import CheckpointManager, ResumeState
from relax_hpc.data.sample import Sample


@dataclass(frozen=True)
class ActorConfig:
    model_path: str
    optim: OptimConfig
    loss: LossConfig
    checkpoint_dir: str
    keep_last: int
    seed: int
    dtype: str = "float32"
    device: str = "cpu"
    temperature: float = 1.0
    num_threads: int = 0


class ActorWorker:
    def __init__(self, cfg: ActorConfig, rank: int = 0, world_size: int = 1, master: str = "") -> None:
        if cfg.num_threads > 0:
            torch.set_num_threads(cfg.num_threads)
        if world_size > 1:
            backend = "nccl" if cfg.device.startswith("cuda") else "gloo"
            dist.init_process_group(backend, init_method=f"tcp://{master}", rank=rank, world_size=world_size)
        torch.manual_seed(cfg.seed + rank)
        self.rank, self.world_size = rank, world_size
        self.backend = TorchBackend(
            cfg.model_path, cfg.optim, cfg.loss, dtype=cfg.dtype, device=cfg.device,
            temperature=cfg.temperature,
        )
        self.checkpoints = CheckpointManager(Path(cfg.checkpoint_dir), keep_last=cfg.keep_last)

    def train(self, samples: list[Sample]) -> dict[str, float]:
        return self.backend.train(samples)

    def export_weights(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, t.clone()) for n, t in self.backend.named_weights()]

    def compute_log_probs(self, samples: list[Sample]) -> list[list[float]]:
        return self.backend.compute_log_probs(samples)

    def save_checkpoint(self, state: ResumeState) -> str:
        return str(self.backend.save_checkpoint(self.checkpoints, state))

    def load_checkpoint(self) -> ResumeState | None:
        return self.backend.load_checkpoint(self.checkpoints)

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
