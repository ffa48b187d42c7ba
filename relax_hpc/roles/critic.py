"""The Critic role: PPO's value model, which writes each step's token-level GAE advantages and trains.

With `[algorithm] advantage = "gae"` rollout queues rows without `advantages`. For each step the
driver submits `CriticWorker.train_step(step)` beside the trainer's step (calls run in order, as
the trainer's do), which:

1. takes the step's rows once the partition is complete (whitening needs all of them, as a
   group's advantage does for the Advantages role),
2. computes ``V_t`` of every response token with the critic as trained on the steps before,
3. writes each row's whitened GAE advantages (one per response token; relax_hpc/algos/gae.py)
   back onto the queue and acks the rows (the trainer, waiting for the field, starts at once),
4. takes one AdamW step of the critic on the clipped value loss against the returns, while the
   actor trains on the advantages.

It returns the step's critic metrics: `critic/loss`, `critic/explained_variance` (of the values
it used for the advantages), `critic/value_error`, `critic/clip_frac`, `critic/grad_norm`,
`critic/values_mean`, `critic/returns_mean`, and the step's `rows` and `reward_sum` (what the
loop reports while the critic warms up and the actor does not train).

A critic killed mid-step is a dead role like a trainer rank: the run restarts globally from the
newest checkpoint, which holds the critic's model and optimizer (`save_checkpoint`, written with
the actor's and loaded at the actor's step).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from relax_hpc.algos.gae import explained_variance, gae_step
from relax_hpc.backends.batch import pack_rows
from relax_hpc.backends.value_model import ValueOptimConfig, ValueTrainer
from relax_hpc.models.hf import load_tokenizer
from relax_hpc.roles.heartbeat import Heartbeats
from relax_hpc.spec.schema import AlgorithmSpec, CheckpointSpec, CriticSpec, JobInfoSpec, JobSpec
from relax_hpc.transfer.connect import connect_queue
from relax_hpc.transfer.queue import partition_name

INPUT_FIELDS = ("tokens", "prompt_length", "loss_mask", "rollout_log_probs", "rewards")
OUTPUT_FIELD = "advantages"
WHOLE_STEP = 1 << 30  # one batch: the queue hands it out when the partition is complete
CRITIC_CHECKPOINTS = "checkpoints_critic"  # in the job directory, beside checkpoints/


ROWS_WAIT_S = 3600.0  # how long the critic waits for a step's rows (as the forward role does)


@dataclass(frozen=True)
class CriticConfig:
    model_path: str
    checkpoint_dir: str
    keep_last: int = CheckpointSpec.keep_last
    lr: float = CriticSpec.lr
    grad_clip: float = CriticSpec.grad_clip
    micro_batch_size: int = CriticSpec.micro_batch_size
    warmup_steps: int = CriticSpec.warmup_steps
    gamma: float = AlgorithmSpec.gamma
    lam: float = AlgorithmSpec.lam
    value_clip_eps: float | None = AlgorithmSpec.value_clip_eps
    loss_agg: str = AlgorithmSpec.loss_agg
    device: str = "cpu"
    num_threads: int = 0
    seed: int = JobInfoSpec.seed
    timeout_s: float = ROWS_WAIT_S
    kind: str = "critic"


def critic_config(spec: JobSpec, job_dir: Path, device: str) -> CriticConfig | None:
    """The critic the spec asks for (`[critic]`, with advantage = "gae"), or None."""
    c, a = spec.critic, spec.algorithm
    if c is None or a.advantage != "gae":
        return None
    return CriticConfig(
        model_path=c.model_path or spec.model.path, checkpoint_dir=str(job_dir / CRITIC_CHECKPOINTS),
        keep_last=spec.checkpoint.keep_last, lr=c.lr, grad_clip=c.grad_clip, micro_batch_size=c.micro_batch_size,
        warmup_steps=c.warmup_steps, gamma=a.gamma, lam=a.lam, value_clip_eps=a.value_clip_eps,
        loss_agg=a.loss_agg, device=device, num_threads=1, seed=spec.job.seed)


class CriticWorker(Heartbeats):
    """The critic on one device; a plain class, placed as one Ray actor (or run in process)."""

    def __init__(self, cfg: CriticConfig) -> None:
        if cfg.num_threads > 0:
            torch.set_num_threads(cfg.num_threads)
        self.cfg = cfg
        self.trainer = ValueTrainer(cfg.model_path, ValueOptimConfig(
            cfg.lr, cfg.grad_clip, cfg.micro_batch_size, cfg.value_clip_eps, cfg.loss_agg), cfg.device, cfg.seed)
        tok = load_tokenizer(cfg.model_path)
        self.pad_id = int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
        self._queue: Any = None
        self._training: int | None = None

    def weight_version(self) -> int:
        """The role handles ask every role once it is up; the critic sends no weights."""
        return 0

    def pid(self) -> int:
        """This process's id (the fault suite kills it)."""
        return os.getpid()

    def doing(self) -> str:
        return "idle" if self._training is None else f"critic step {self._training}"

    def train_step(self, target: Any, step: int) -> dict[str, float]:
        """Advantages for every row of `step`, then one optimizer step of the critic (module docstring)."""
        self._training = step
        if self._queue is None:
            self._queue = connect_queue(target, self.cfg.kind)
        partition = partition_name(step)
        rows, indices = self._whole_step(partition)
        # pack_rows reads an advantage per row; these rows have none yet, and the critic needs none.
        batch = pack_rows([{**row, OUTPUT_FIELD: 0.0} for row in rows], self.pad_id)
        rewards = torch.tensor([float(row["rewards"]) for row in rows], dtype=torch.float64)
        values = self.trainer.values(batch)
        mask = batch.loss_mask
        advantages, returns = gae_step(rewards, values.double(), mask, self.cfg.gamma, self.cfg.lam)
        self._queue.write(partition, indices, [{OUTPUT_FIELD: adv} for adv in _per_row(advantages, rows)])
        self._queue.ack(partition, self.cfg.kind, indices)
        stats = self.trainer.train(batch, values, returns.float())
        keep = mask.bool()
        self._training = None
        return {
            "rows": float(len(rows)), "reward_sum": float(rewards.sum()),
            **{f"critic/{k}": v for k, v in stats.items()},
            "critic/explained_variance": explained_variance(values, returns, mask),
            "critic/values_mean": float(values[keep].mean()) if keep.any() else 0.0,
            "critic/returns_mean": float(returns[keep].mean()) if keep.any() else 0.0,
        }

    def _whole_step(self, partition: str) -> tuple[list[dict[str, Any]], list[int]]:
        rows: list[dict[str, Any]] = []
        indices: list[int] = []
        deadline = time.monotonic() + self.cfg.timeout_s
        while True:
            try:
                batch = self._queue.get(partition, self.cfg.kind, INPUT_FIELDS, WHOLE_STEP, timeout=1.0)
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the critic waited {self.cfg.timeout_s:.0f} s for the rows of {partition}: "
                                       "rollout produced none (see the rollout role's log)") from None
                continue
            rows.extend(batch.rows)
            indices.extend(batch.indices)
            if batch.end:
                return rows, indices

    def save_checkpoint(self, step: int) -> str:
        return str(self.trainer.save(Path(self.cfg.checkpoint_dir), step, self.cfg.keep_last))

    def load_checkpoint(self, step: int | None) -> None:
        """The critic as saved at `step` (the actor's resume point); None: a fresh run, nothing to load."""
        if step is not None:
            self.trainer.load(Path(self.cfg.checkpoint_dir), step)

    def memory_record(self) -> dict[str, Any]:
        params = sum(p.numel() * p.element_size() for p in self.trainer.model.parameters())
        return {"role": "critic", "parameters_bytes": params}

    def shutdown(self) -> None:
        if self._queue is not None:
            self._queue.close()
            self._queue = None


def _per_row(per_token: torch.Tensor, rows: list[dict[str, Any]]) -> list[torch.Tensor]:
    """Each row's values at its response columns (the packed layout: columns P-1 .. P+R-2)."""
    out = []
    for i, row in enumerate(rows):
        p, n = int(row["prompt_length"]), int(row["tokens"].shape[0])
        out.append(per_token[i, p - 1 : n - 1].float().contiguous())
    return out
