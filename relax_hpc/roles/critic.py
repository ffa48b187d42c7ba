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

With `[critic] num_processes` > 1 each rank (`CriticWorker(cfg, rank, world_size, master)`, in a
process group of the critic's own) does 2 to 4 for its share of the rows: the whitening's mean
and variance and the metrics come from sums all-reduced over the ranks, and the gradient is the
whole step's (backends/value_model.py), so N ranks write and train what one would.
`[critic] strategy` holds the value model whole on every rank (`ddp`) or sharded (`fsdp2`);
`[critic] backend = "megatron"` runs it on megatron-core instead (backends/megatron_value.py),
where the shares are the tensor-parallel replicas' (`trainer.data_rank` of `trainer.data_size`).

A critic rank killed mid-step is a dead role like a trainer rank: the run restarts globally from
the newest checkpoint, which holds the critic's model and optimizer (`save_checkpoint`, collective,
written with the actor's and loaded at the actor's step).
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from relax_hpc.algos.gae import (
    gae_advantages_returns,
    terminal_rewards,
    token_moments,
    value_metrics,
    value_moments,
    whiten_by_moments,
)
from relax_hpc.backends.batch import TrainBatch, pack_rows
from relax_hpc.backends.parallel import Strategy
from relax_hpc.backends.value_model import ValueOptimConfig, ValueTrainer
from relax_hpc.models.hf import load_tokenizer
from relax_hpc.roles.actor import join_rank_group
from relax_hpc.roles.heartbeat import Heartbeats
from relax_hpc.spec.schema import (
    AlgorithmSpec,
    CheckpointSpec,
    CriticSpec,
    JobInfoSpec,
    JobSpec,
    MegatronSpec,
    TrainSpec,
)
from relax_hpc.transfer.connect import connect_queue
from relax_hpc.transfer.queue import partition_name

INPUT_FIELDS = ("tokens", "prompt_length", "loss_mask", "rollout_log_probs", "rewards")
OUTPUT_FIELD = "advantages"
WHOLE_STEP = 1 << 30  # one batch: the queue hands it out when the partition is complete
CRITIC_CHECKPOINTS = "checkpoints_critic"  # in the job directory, beside checkpoints/


ROWS_WAIT_S = 3600.0  # how long the critic waits for a step's rows (as the forward role does)


@dataclass(frozen=True)
class CriticConfig:
    """What a critic rank runs: the `[critic]` and `[algorithm]` tables as the spec gives them
    (`critic_config` fills in the strategy an unset `[critic] strategy` follows), and what the
    driver resolves."""

    model_path: str  # [critic] model_path, else [model] path
    checkpoint_dir: str
    table: CriticSpec = field(default_factory=CriticSpec)  # [critic]
    algo: AlgorithmSpec = field(default_factory=AlgorithmSpec)  # gamma, lam, value_clip_eps, loss_agg
    keep_last: int = CheckpointSpec.keep_last
    device: str = "cpu"
    num_threads: int = 0
    seed: int = JobInfoSpec.seed
    timeout_s: float = ROWS_WAIT_S
    kind: str = "critic"

    @property
    def strategy(self) -> Strategy:
        return self.table.strategy or TrainSpec.strategy

    @property
    def backend(self) -> str:
        return self.table.backend or TrainSpec.backend

    @property
    def megatron(self) -> MegatronSpec:
        return self.table.megatron or MegatronSpec()


def critic_config(spec: JobSpec, job_dir: Path, device: str) -> CriticConfig | None:
    """The critic the spec asks for (`[critic]`, with advantage = "gae"), or None."""
    c, a = spec.critic, spec.algorithm
    if c is None or a.advantage != "gae":
        return None
    return CriticConfig(
        model_path=c.model_path or spec.model.path, checkpoint_dir=str(job_dir / CRITIC_CHECKPOINTS),
        table=dataclasses.replace(c, strategy=c.strategy or spec.train.strategy, backend=c.backend or spec.train.backend,
                                  megatron=c.megatron or spec.train.megatron), algo=a,
        keep_last=spec.checkpoint.keep_last, device=device, num_threads=1, seed=spec.job.seed)


class CriticWorker(Heartbeats):
    """Rank `rank` of the critic's `world_size` ranks (`[critic] num_processes`); a plain class,
    placed as one Ray actor per rank (or run in process: one rank). With several ranks they form
    a process group of their own (`join_rank_group`, the rendezvous through rank 0's sealed store
    at `master`), separate from the trainer's; each computes the values of its share of a step's
    rows (the rows whose index is `rank` modulo `world_size`), and the advantages are whitened
    with the whole step's mean and variance (`token_moments`, summed over the ranks)."""

    def __init__(self, cfg: CriticConfig, rank: int = 0, world_size: int = 1, master: str = "") -> None:
        if cfg.num_threads > 0:
            torch.set_num_threads(cfg.num_threads)
        self.cfg = cfg
        self.rank, self.world_size = rank, world_size
        self.device = join_rank_group("critic", cfg.device, rank, world_size, master)
        tok = load_tokenizer(cfg.model_path)
        self.pad_id = int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
        c, a = cfg.table, cfg.algo
        optim = ValueOptimConfig(c.lr, c.grad_clip, c.micro_batch_size, a.value_clip_eps, a.loss_agg, cfg.strategy)
        self.trainer: Any
        if cfg.backend == "megatron":
            from relax_hpc.backends.megatron_value import MegatronValueTrainer

            self.trainer = MegatronValueTrainer(cfg.model_path, optim, cfg.megatron, self.device, cfg.seed, self.pad_id)
        else:
            self.trainer = ValueTrainer(cfg.model_path, optim, self.device, cfg.seed, self.pad_id)
        # Each rank reads every row of a step as a task of its own (and under a consumer id of its own:
        # sessions of one id fence each other off), and keeps its share.
        self.consumer = cfg.kind if world_size == 1 else f"{cfg.kind}_{rank}"
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
        """Advantages for this rank's rows of `step`, then one optimizer step of the critic over
        every rank's rows (module docstring); the statistics are the whole step's on every rank."""
        self._training = step
        if self._queue is None:
            self._queue = connect_queue(target, self.consumer)
        partition = partition_name(step)
        every_row, every_index = self._whole_step(partition)
        share = self.trainer.data_rank, self.trainer.data_size  # Megatron: tensor-parallel peers share rows
        mine = sorted(range(len(every_index)), key=lambda k: every_index[k])[share[0]::share[1]]
        rows, indices = [every_row[k] for k in mine], [every_index[k] for k in mine]
        # pack_rows reads an advantage per row; these rows have none yet, and the critic needs none.
        batch = pack_rows([{**row, OUTPUT_FIELD: 0.0} for row in rows], self.pad_id) if rows else None
        values = self.trainer.values(batch)
        advantages, returns = self._advantages(batch, values, rows)
        if rows and self.trainer.writes_rows:
            self._queue.write(partition, indices, [{OUTPUT_FIELD: adv} for adv in _per_row(advantages, rows)])
        self._queue.ack(partition, self.consumer, every_index)
        stats = self.trainer.train(batch, values, None if returns is None else returns.float())
        reward_sum = sum(float(row["rewards"]) for row in rows)
        metrics = self._value_metrics(batch, values, returns)
        rows_total, reward_total = self.trainer.sum_over_ranks(
            torch.tensor([float(len(rows)), reward_sum], dtype=torch.float64)).tolist()
        self._training = None
        return {
            "rows": rows_total, "reward_sum": reward_total,
            **{f"critic/{k}": v for k, v in stats.items()},
            **{f"critic/{k}": v for k, v in metrics.items()},
        }

    def _advantages(self, batch: TrainBatch | None, values: torch.Tensor | None,
                    rows: list[dict[str, Any]]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """This rank's whitened GAE advantages and returns; the whitening's moments are summed
        over every rank, so each token gets what one process with the whole step would give it."""
        adv = returns = None
        moments = torch.zeros(3, dtype=torch.float64)
        if batch is not None and values is not None:
            rewards = torch.tensor([float(row["rewards"]) for row in rows], dtype=torch.float64)
            adv, returns = gae_advantages_returns(terminal_rewards(rewards, batch.loss_mask), values.double(),
                                                  batch.loss_mask, self.cfg.algo.gamma, self.cfg.algo.lam)
            moments = token_moments(adv, batch.loss_mask)
        moments = self.trainer.sum_over_ranks(moments)
        if adv is None or batch is None:
            return None, None
        return whiten_by_moments(adv, batch.loss_mask, moments), returns

    def _value_metrics(self, batch: TrainBatch | None, values: torch.Tensor | None,
                       returns: torch.Tensor | None) -> dict[str, float]:
        """Explained variance and the means of the values the advantages came from, over the step."""
        moments = torch.zeros(6, dtype=torch.float64)
        if batch is not None and values is not None and returns is not None:
            moments = value_moments(values, returns, batch.loss_mask)
        return value_metrics(self.trainer.sum_over_ranks(moments))

    def _whole_step(self, partition: str) -> tuple[list[dict[str, Any]], list[int]]:
        rows: list[dict[str, Any]] = []
        indices: list[int] = []
        deadline = time.monotonic() + self.cfg.timeout_s
        while True:
            try:
                batch = self._queue.get(partition, self.consumer, INPUT_FIELDS, WHOLE_STEP, timeout=1.0)
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
        return {"role": "critic" if self.world_size == 1 else f"critic rank {self.rank}",
                "parameters_bytes": self.trainer.parameter_bytes()}

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
