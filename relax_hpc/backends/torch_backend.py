"""The torch training backend: an HF causal LM trained with AdamW, micro-batches and grad clipping.

It is the embedded default. With several trainer processes it runs data parallel over
torch.distributed (gloo on CPU, NCCL on GPU): each rank trains on its shard of the batch and
gradients are averaged with all-reduce before the optimizer step.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch
import torch.distributed as dist

from relax_hpc.algos import (
    LossConfig,
    LossInputs,
    opd_advantages,
    policy_loss,
    token_logprobs_and_entropy,
)
from relax_hpc.backends.batch import TrainBatch, pack_samples
from relax_hpc.ckpt import CheckpointManager, ResumeState
from relax_hpc.data.sample import Sample
from relax_hpc.models.hf import load_causal_lm, load_tokenizer


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-6
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0  # 0 disables clipping
    micro_batch_size: int = 8
    mini_batches: int = 1  # optimizer steps per rollout batch


class TorchBackend:
    """A `TrainBackend`: train on samples or packed batches, recompute log-probs, export weights,
    checkpoint."""

    def __init__(
        self,
        model_path: str | Path,
        optim: OptimConfig,
        loss: LossConfig,
        dtype: str = "float32",
        device: str = "cpu",
        temperature: float = 1.0,
        teacher_path: str | Path | None = None,
        opd_coef: float = 1.0,
        keep_reference: bool = True,
    ) -> None:
        self.device = torch.device(device)
        self.model = load_causal_lm(model_path, dtype=dtype, device=device)
        self.model.train()
        # Dropout would make recomputed log-probs differ from the engine's. The attention modules
        # copy the rate from the config when they are built, so the config alone is not enough.
        self.model.config.attention_dropout = 0.0
        for module in self.model.modules():
            if hasattr(module, "attention_dropout"):
                module.attention_dropout = 0.0
        tokenizer = load_tokenizer(model_path)
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else tokenizer.eos_token_id)
        self.optim_cfg, self.loss_cfg, self.temperature = optim, loss, temperature
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=optim.lr, betas=optim.adam_betas,
            weight_decay=optim.weight_decay,
        )
        self.reference: torch.nn.Module | None = None
        if loss.kl_coef > 0 and keep_reference:  # else a Reference role supplies ref_log_probs
            self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)
        # On-policy distillation: a frozen teacher whose log-probs shape the per-token advantage.
        self.teacher: torch.nn.Module | None = None
        if teacher_path is not None:
            self.teacher = load_causal_lm(teacher_path, dtype=dtype, device=device).eval().requires_grad_(False)
        self.opd_coef = opd_coef
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1

    # -- log-probs -----------------------------------------------------------------------------

    def _logprobs(self, model: torch.nn.Module, batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        return token_logprobs_and_entropy(logits[:, :-1], batch.targets, self.temperature)

    def _advantages(self, micro: TrainBatch, logp: torch.Tensor) -> torch.Tensor:
        """Per-sequence advantages, or per-token ones with the teacher's pull under OPD."""
        if self.teacher is None:
            return micro.advantages
        with torch.no_grad():
            teacher_logp = self._logprobs(self.teacher, micro)[0]
        return opd_advantages(micro.advantages, logp.detach(), teacher_logp, micro.loss_mask, self.opd_coef)

    @torch.no_grad()
    def compute_log_probs(self, samples: list[Sample], reference: bool = False) -> list[list[float]]:
        """Recompute per-token log-probs of each sample's response under the current (or reference) model."""
        model = self.reference if reference else self.model
        if model is None:
            raise RuntimeError("no reference model: set [algorithm] kl_coef > 0 to keep one")
        out: list[list[float]] = []
        step = self.optim_cfg.micro_batch_size
        for start in range(0, len(samples), step):
            chunk = samples[start : start + step]
            batch = pack_samples(chunk, self.pad_id).to(self.device)
            logp, _ = self._logprobs(model, batch)
            for i, s in enumerate(chunk):
                p = len(s.prompt_ids)
                out.append(logp[i, p - 1 : p - 1 + len(s.response_ids)].tolist())
        return out

    # -- training ------------------------------------------------------------------------------

    def train(self, samples: list[Sample]) -> dict[str, float]:
        """One rollout batch: `mini_batches` optimizer steps over this rank's samples."""
        return self.train_batch(pack_samples(samples, self.pad_id))

    def train_batch(self, batch: TrainBatch) -> dict[str, float]:
        """`train` on an already packed batch (`pack_samples` or `pack_rows`, on any device)."""
        batch = batch.to(self.device)
        with torch.no_grad():  # fields from the ActorFwd / Reference roles win when present
            old_logp = batch.old_log_probs
            if old_logp is None:
                old_logp = self._full_logprobs(self.model, batch)
            ref_logp = batch.ref_log_probs
            if ref_logp is None and self.reference is not None:
                ref_logp = self._full_logprobs(self.reference, batch)
        stats: dict[str, list[float]] = {}
        mini = self.optim_cfg.mini_batches
        size = math.ceil(len(batch) / mini)
        for start in range(0, len(batch), size):
            stop = min(start + size, len(batch))
            for k, v in self._optimizer_step(batch, old_logp, ref_logp, start, stop).items():
                stats.setdefault(k, []).append(v)
        return {k: sum(v) / len(v) for k, v in stats.items()}

    def _full_logprobs(self, model: torch.nn.Module, batch: TrainBatch) -> torch.Tensor:
        step = self.optim_cfg.micro_batch_size
        parts = [self._logprobs(model, batch.slice(i, i + step))[0] for i in range(0, len(batch), step)]
        return torch.cat(parts)

    def _optimizer_step(
        self, batch: TrainBatch, old_logp: torch.Tensor, ref_logp: torch.Tensor | None,
        start: int, stop: int,
    ) -> dict[str, float]:
        self.optimizer.zero_grad(set_to_none=True)
        total = stop - start
        stats: dict[str, float] = {}
        step = self.optim_cfg.micro_batch_size
        for i in range(start, stop, step):
            j = min(i + step, stop)
            micro = batch.slice(i, j)
            logp, entropy = self._logprobs(self.model, micro)
            inputs = LossInputs(
                logp=logp, old_logp=old_logp[i:j], advantages=self._advantages(micro, logp),
                mask=micro.loss_mask, ref_logp=None if ref_logp is None else ref_logp[i:j],
                rollout_logp=micro.rollout_log_probs, entropy=entropy,
            )
            loss, micro_stats = policy_loss(self.loss_cfg, inputs)
            # Each micro-batch's mean is weighted by its share of the mini-batch.
            (loss * (j - i) / total).backward()
            for k, v in micro_stats.items():
                stats[k] = stats.get(k, 0.0) + v * (j - i) / total
        self._all_reduce_grads()
        clip = self.optim_cfg.grad_clip
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
        self.optimizer.step()
        stats["grad_norm"] = float(norm)
        return stats

    def train_stream(self, micro_batches: Iterable[TrainBatch]) -> dict[str, float]:
        """One optimizer step over packed micro-batches consumed as they arrive (the streaming loader).

        The trainer packs queue rows with `pack_rows` (pad with `self.pad_id`) as they arrive;
        each micro-batch's mean loss is back-propagated weighted by its row count; once the
        stream ends, gradients are summed over ranks and divided by the total row count, so
        the step equals one pass over the whole batch however the rows were split. The old
        log-probs are the current policy's (one optimizer step per rollout batch).
        """
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        rows = 0
        for packed in micro_batches:
            micro = packed.to(self.device)
            logp, entropy = self._logprobs(self.model, micro)
            # Fields written by the ActorFwd / Reference roles are used when present; otherwise
            # the trainer computes them itself.
            ref_logp = micro.ref_log_probs
            if ref_logp is None and self.reference is not None:
                with torch.no_grad():
                    ref_logp = self._logprobs(self.reference, micro)[0]
            old_logp = micro.old_log_probs if micro.old_log_probs is not None else logp.detach()
            inputs = LossInputs(
                logp=logp, old_logp=old_logp, advantages=self._advantages(micro, logp),
                mask=micro.loss_mask, ref_logp=ref_logp, rollout_logp=micro.rollout_log_probs,
                entropy=entropy,
            )
            loss, micro_stats = policy_loss(self.loss_cfg, inputs)
            (loss * len(micro)).backward()
            rows += len(micro)
            for k, v in micro_stats.items():
                sums[k] = sums.get(k, 0.0) + v * len(micro)
        total = self._sum_over_ranks(float(rows))
        if total == 0:
            raise RuntimeError("the training step received no rows; is rollout producing?")
        self._all_reduce_grads(average=False)
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad /= total
        clip = self.optim_cfg.grad_clip
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
        self.optimizer.step()
        stats = {k: self._sum_over_ranks(v) / total for k, v in sums.items()}
        stats["grad_norm"] = float(norm)
        return stats

    def _sum_over_ranks(self, value: float) -> float:
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return float(t.item())

    def _all_reduce_grads(self, average: bool = True) -> None:
        if self.world_size == 1:
            return
        for p in self.model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            if average:
                p.grad /= self.world_size

    # -- weights and checkpoints ---------------------------------------------------------------

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.model.state_dict().items():
            yield name, tensor.detach()

    def save_checkpoint(self, manager: CheckpointManager, state: ResumeState) -> Path:
        return manager.save(state.step, self.model, self.optimizer, state)

    def load_checkpoint(self, manager: CheckpointManager) -> ResumeState | None:
        return manager.load_latest(self.model, self.optimizer)
