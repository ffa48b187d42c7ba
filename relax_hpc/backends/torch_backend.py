"""The torch training backend: an HF causal LM trained with AdamW, micro-batches and grad clipping.

It is the embedded default. With several trainer processes it runs data parallel over
torch.distributed (gloo on CPU, NCCL on GPU): each rank trains on its shard of the batch. With
`strategy = "ddp"` every rank holds the whole model and gradients are summed with all-reduce
before the optimizer step; with `"fsdp2"` parameters, gradients and optimizer state are sharded
over the ranks (`relax_hpc.backends.parallel`) and FSDP2 sums the gradients with reduce-scatter.

Every optimizer step takes the gradient of the loss of its whole batch, however the rows are
split into micro-batches and ranks: the aggregation's denominator (trained tokens for
`token_mean`, sequences for `seq_mean_token_mean`) is the count over all micro-batches and all
ranks of the step, not each micro-batch's own (see `relax_hpc.algos.aggregation`).

The policy trains float32 master weights whatever `[model] dtype` is (AdamW steps of lr 1e-6
would round away in bfloat16); the dtype is what it computes in (FSDP2's mixed precision when
sharded, autocast otherwise) and what its weights leave in for the engines (`named_weights`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F

from relax_hpc.algos import (
    LossInputs,
    LossSettings,
    opd_advantages,
    policy_loss,
    token_logprobs_and_entropy,
)
from relax_hpc.algos.aggregation import loss_denominator
from relax_hpc.backends.base import OptimSettings, StepStats, adam_betas
from relax_hpc.backends.batch import TrainBatch, pack_samples
from relax_hpc.backends.parallel import (
    STRATEGIES,
    Strategy,
    full_weights,
    in_lockstep,
    keep_float32_masters,
    shard_model,
)
from relax_hpc.backends.sharded_load import load_model
from relax_hpc.data.sample import Sample
from relax_hpc.media.processor import media_processor_for
from relax_hpc.models.hf import is_multimodal, load_tokenizer

if TYPE_CHECKING:  # annotations only: DCP loads when a checkpoint is saved or loaded, not with the backend
    from relax_hpc.ckpt import CheckpointManager, ResumeState

T = TypeVar("T")


class TorchBackend:
    """A `TrainBackend`: train on samples or packed batches, recompute log-probs, export weights,
    checkpoint."""

    reads_rows = True  # every rank trains on rows of its own

    def __init__(
        self,
        model_path: str | Path,
        optim: OptimSettings,
        loss: LossSettings,
        dtype: str = "float32",
        device: str = "cpu",
        temperature: float = 1.0,
        teacher_path: str | Path | None = None,
        opd_coef: float = 1.0,
        keep_reference: bool = True,
        strategy: Strategy = "ddp",
    ) -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy={strategy!r}: use one of {', '.join(STRATEGIES)} ([train] strategy)")
        self.device = torch.device(device)
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        # One CPU process has nothing to shard: fsdp2 then trains the whole model, as ddp does. One
        # CUDA rank still wraps, computing through FSDP2's mixed precision rather than autocast,
        # when it runs in a process group (benchmarks/gpu_check.py makes one; the trainer role
        # makes one only for several ranks).
        self.sharded = strategy == "fsdp2" and (
            self.world_size > 1 or (self.device.type == "cuda" and dist.is_initialized()))
        # Master weights: the policy's parameters, gradients and AdamW state are float32 whatever
        # `dtype` is; `dtype` is the compute dtype (the reference and teacher, inference only, stay
        # in it), and the dtype each weight leaves in for the engines (`named_weights`).
        self.compute_dtype: torch.dtype = getattr(torch, dtype)
        self.weight_dtypes: dict[str, torch.dtype] = {}

        def keep_masters(model: torch.nn.Module) -> None:  # before sharding: FSDP2 shards them
            self.weight_dtypes = keep_float32_masters(model)

        # Sharded, every model is built on the meta device and sharded (FSDP2 casts to the compute
        # dtype as it all-gathers); only this rank's shards are ever materialised on its device,
        # filled from rank 0's host copy (sharded_load). Else each model loads whole.
        shard = (lambda model: shard_model(model, self.device, self.compute_dtype)) if self.sharded else None
        self.model = load_model(model_path, dtype, self.device, shard, prepare=keep_masters)
        self.model.train()
        # A multimodal model: each micro-batch's media tensors and M-RoPE positions are built
        # from its rows' canonical media, exactly as the engine builds them for the prompt.
        self.media_processor = media_processor_for(model_path)
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
        # The frozen reference (the policy as loaded) and teacher are laid out like the policy: whole
        # on every rank, or sharded the same way, never a whole copy (their forwards are then
        # collectives too, see `_in_lockstep`).
        self.reference: torch.nn.Module | None = None
        if loss.kl_coef > 0 and keep_reference:  # else a Reference role supplies ref_log_probs
            self.reference = load_model(model_path, dtype, self.device, shard).eval().requires_grad_(False)
        # On-policy distillation: a frozen teacher whose log-probs shape the per-token advantage.
        self.teacher: torch.nn.Module | None = None
        if teacher_path is not None:
            if is_multimodal(teacher_path):
                raise ValueError("on-policy distillation from a multimodal teacher is not supported yet; "
                                 "use a text-only teacher model")
            self.teacher = load_model(teacher_path, dtype, self.device, shard).eval().requires_grad_(False)
        self.opd_coef = opd_coef
        # Unsharded, autocast computes in it from the float32 parameters (`_compute`).
        self._autocast = not self.sharded and self.compute_dtype != torch.float32
        # After sharding: FSDP2 replaces the parameters with sharded ones.
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=optim.lr, betas=adam_betas(optim),
            weight_decay=optim.weight_decay,
        )

    # -- log-probs -----------------------------------------------------------------------------

    def _logprobs(self, model: torch.nn.Module, batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
        extra = self._media_kwargs(model, batch) if model is not self.teacher else {}
        with self._compute():
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False,
                           **extra).logits
        if extra:  # the engine never samples media markup (MediaProcessor.mask_markup)
            logits = self.media_processor.mask_markup(logits)
        return token_logprobs_and_entropy(logits[:, :-1], batch.targets, self.temperature)

    def _media_kwargs(self, model: torch.nn.Module, batch: TrainBatch) -> dict[str, Any]:
        if self.media_processor is None:
            return {}
        from relax_hpc.media.positions import rows_forward_kwargs

        return rows_forward_kwargs(model, self.media_processor, batch.input_ids, batch.attention_mask, batch.media)

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
        for start in self._in_lockstep(range(0, len(samples), step), model):
            if start is None:
                self._empty_pass(backward=False, model=model)
                continue
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

    def train_batch(self, batch: TrainBatch | None) -> dict[str, float]:
        """`train` on an already packed batch (`pack_samples` or `pack_rows`, on any device).

        Every rank takes `mini_batches` optimizer steps, each over its own share of this rank's
        rows (shares differ by at most one row), so the ranks' collectives pair up whatever
        their row counts; None: this rank received no rows this step and still takes part.
        A mini-batch without a row on any rank is skipped (no optimizer step)."""
        batch = None if batch is None else batch.to(self.device)
        rows = 0 if batch is None else len(batch)
        mini = self.optim_cfg.mini_batches
        with torch.no_grad():  # fields from the ActorFwd / Reference roles win when present
            old_logp = None if batch is None else batch.old_log_probs
            # With one optimizer step the "old" policy is the one being trained, and each
            # micro-batch's own log-probs, detached, are it: no separate forward of the batch
            # (it was a third of a step's time). Later mini-batches need the step's start.
            if old_logp is None and mini > 1:
                old_logp = self._full_logprobs(self.model, batch)
            ref_logp = None if batch is None else batch.ref_log_probs
            if ref_logp is None and self.reference is not None:  # rowless ranks too: collective when sharded
                ref_logp = self._full_logprobs(self.reference, batch)
        stats: dict[str, list[float]] = {}
        for k in range(mini):
            step_stats = self._optimizer_step(batch, old_logp, ref_logp, k * rows // mini, (k + 1) * rows // mini)
            for key, v in (step_stats or {}).items():
                stats.setdefault(key, []).append(v)
        if not stats:
            raise RuntimeError("the training step received no rows; is rollout producing?")
        return {k: sum(v) / len(v) for k, v in stats.items()}

    def _full_logprobs(self, model: torch.nn.Module, batch: TrainBatch | None) -> torch.Tensor | None:
        """Log-probs of the whole batch in micro-batches; None for a rank without rows (which
        still runs the empty passes a sharded model's collectives need)."""
        step = self.optim_cfg.micro_batch_size
        parts = []
        for i in self._in_lockstep(range(0, 0 if batch is None else len(batch), step), model):
            if i is None or batch is None:
                self._empty_pass(backward=False, model=model)
            else:
                logp = self._logprobs(model, batch.slice(i, i + step).trimmed())[0]
                parts.append(F.pad(logp, (0, batch.targets.size(1) - logp.size(1))))  # the batch's width
        return torch.cat(parts) if parts else None

    def _optimizer_step(
        self, batch: TrainBatch | None, old_logp: torch.Tensor | None, ref_logp: torch.Tensor | None,
        start: int, stop: int,
    ) -> dict[str, float] | None:
        """One optimizer step on rows start..stop of this rank's batch (and the other ranks' rows);
        None, and no step, when no rank has a row in it."""
        self.optimizer.zero_grad(set_to_none=True)
        # The step's loss aggregates every rank's rows of this mini-batch at once, so each
        # micro-batch's loss is divided by their global token (or sequence) count.
        local = 0.0 if batch is None or stop <= start else loss_denominator(
            batch.loss_mask[start:stop], self.loss_cfg.loss_agg)
        count, rows = self._sum_over_ranks([local, float(stop - start)])
        if rows == 0:  # the same answer on every rank: all skip together
            return None
        denominator = max(count, 1.0)  # no trained token at all: the loss is 0 whatever we divide by
        stats = StepStats()
        step = self.optim_cfg.micro_batch_size
        for i in self._in_lockstep(range(start, stop, step), self.model):
            if i is None or batch is None:
                self._empty_pass(backward=True)
                continue
            j = min(i + step, stop)
            micro = batch.slice(i, j).trimmed()  # no positions past its own longest row
            width = micro.targets.size(1)
            micro_ref = None if ref_logp is None else ref_logp[i:j, :width]
            micro_old = None if old_logp is None else old_logp[i:j, :width]
            stats.add(self._backward_micro(micro, micro_old, micro_ref, denominator), micro.loss_mask)
        self._all_reduce_grads()
        reduced = stats.reduce(self._sum_over_ranks, names=self._names_over_ranks(stats.sums))
        reduced["grad_norm"] = self._clip_and_step()
        return reduced

    def train_stream(self, micro_batches: Iterable[TrainBatch]) -> dict[str, float]:
        """One optimizer step over packed micro-batches consumed as they arrive (the streaming loader).

        The trainer packs queue rows with `pack_rows` (pad with `self.pad_id`) as they arrive.
        The step's token (or sequence) count N is known only once the stream ends, so every
        micro-batch of this rank divides by a provisional count p, the first micro-batch's own;
        the gradients are then multiplied by p / N and summed over ranks, so the step equals
        one pass over the whole batch however the rows were split. (p keeps the gradients at
        the scale of a mean while they accumulate: a plain sum over many tokens could overflow
        float16.) Sharded (fsdp2), gradients are summed over ranks at every backward, so all
        ranks share one p: the sum of their first micro-batches' counts. The old log-probs are
        the current policy's (one optimizer step per rollout batch).
        """
        self.optimizer.zero_grad(set_to_none=True)
        stats = StepStats()
        rows, count = 0, 0.0
        provisional: float | None = None
        for packed in self._in_lockstep(micro_batches, self.model):
            if packed is None:
                if provisional is None:
                    provisional = self._provisional_count(0.0)
                self._empty_pass(backward=True, reference=True)
                continue
            micro = packed.to(self.device)
            micro_count = loss_denominator(micro.loss_mask, self.loss_cfg.loss_agg)
            if provisional is None:  # before the reference's forward, as on a rank without rows
                provisional = self._provisional_count(micro_count)
            # Fields written by the ActorFwd / Reference roles are used when present; otherwise
            # the trainer computes them itself.
            ref_logp = micro.ref_log_probs
            if ref_logp is None and self.reference is not None:
                with torch.no_grad():
                    ref_logp = self._logprobs(self.reference, micro)[0]
            stats.add(self._backward_micro(micro, micro.old_log_probs, ref_logp, provisional), micro.loss_mask)
            rows += len(micro)
            count += micro_count
        total_rows, count = self._sum_over_ranks([float(rows), count])
        if total_rows == 0:
            raise RuntimeError("the training step received no rows; is rollout producing?")
        rescale = (provisional or 1.0) / max(count, 1.0)  # no trained token at all: the loss is 0
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad *= rescale
        self._all_reduce_grads()
        reduced = stats.reduce(self._sum_over_ranks, rescale, self._names_over_ranks(stats.sums))
        reduced["grad_norm"] = self._clip_and_step()
        return reduced

    def _backward_micro(
        self, micro: TrainBatch, old_logp: torch.Tensor | None, ref_logp: torch.Tensor | None,
        denominator: float,
    ) -> dict[str, float]:
        """Back-propagate one micro-batch's loss divided by `denominator`; return its stats.

        `old_logp` None means the current policy's (detached) log-probs.
        """
        logp, entropy = self._logprobs(self.model, micro)
        inputs = LossInputs(
            logp=logp, old_logp=logp.detach() if old_logp is None else old_logp,
            advantages=self._advantages(micro, logp), mask=micro.loss_mask, ref_logp=ref_logp,
            rollout_logp=micro.rollout_log_probs, entropy=entropy,
        )
        loss, stats = policy_loss(self.loss_cfg, inputs, denominator)
        loss.backward()
        return stats

    def _provisional_count(self, first_count: float) -> float:
        """The denominator of a stream's micro-batches: this rank's first count; sharded, every rank's."""
        if self.sharded:
            (first_count,) = self._sum_over_ranks([first_count])
        return max(first_count, 1.0)

    def _in_lockstep(self, items: Iterable[T], model: torch.nn.Module) -> Iterator[T | None]:
        """This rank's items, then None until every rank is through its own.

        With sharded parameters every forward and backward of `model` (the policy, and the
        reference and teacher, sharded like it) is collective, so every rank must run as many;
        None asks for an empty pass (`_empty_pass`). Without sharding, only the items.
        """
        if not self.sharded:
            yield from items
            return
        yield from in_lockstep(items, self._sum_over_ranks)

    def _empty_pass(self, backward: bool, model: torch.nn.Module | None = None, reference: bool = False) -> None:
        """A forward (and backward) of one pad token with a zero loss: the collectives of a pass
        for a rank with no rows left, adding nothing to any gradient.

        `model` (default the policy) is the one whose pass it stands for. A training pass
        (`backward`) also runs the frozen models that a rank with rows runs beside the policy,
        in the same order, as sharded their forwards are collectives too: the reference first
        when `reference` (the streamed step computes its log-probs per micro-batch), the OPD
        teacher after the policy's forward (`_advantages`)."""
        ids = torch.full((1, 1), self.pad_id, dtype=torch.long, device=self.device)
        frozen_before = self.reference if backward and reference else None
        frozen_after = self.teacher if backward else None
        with torch.set_grad_enabled(backward):
            with self._compute():
                if frozen_before is not None:
                    with torch.no_grad():
                        frozen_before(input_ids=ids, use_cache=False)
                logits = (model or self.model)(input_ids=ids, use_cache=False).logits
                if frozen_after is not None:
                    with torch.no_grad():
                        frozen_after(input_ids=ids, use_cache=False)
            if backward:
                (logits.sum() * 0.0).backward()

    def _compute(self) -> torch.autocast:
        """Where forwards run: autocast to the compute dtype for an unsharded model with float32
        masters and a lower [model] dtype (the backward then runs in the forward's dtypes and the
        gradients land in float32); a no-op otherwise (sharded, FSDP2 casts the parameters)."""
        return torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=self._autocast)

    def _clip_and_step(self) -> float:
        clip = self.optim_cfg.grad_clip
        params = [p for p in self.model.parameters() if p.grad is not None]
        # Over sharded (DTensor) gradients the norm is a DTensor; full_tensor() reduces it.
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        self.optimizer.step()
        return float(norm)

    def _sum_over_ranks(self, values: list[float]) -> list[float]:
        if self.world_size == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)  # NCCL needs a GPU tensor
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.tolist()

    def _names_over_ranks(self, names: Iterable[str]) -> list[str]:
        """Every rank's stat names: a rank whose share of the step had no rows has none."""
        if self.world_size == 1:
            return sorted(names)
        every: list[list[str] | None] = [None] * self.world_size
        dist.all_gather_object(every, sorted(names))
        return sorted(set().union(*(n or [] for n in every)))

    def _all_reduce_grads(self) -> None:
        """Sum gradients over ranks; not averaged, as the loss was divided by the global count.

        Sharded, FSDP2 has summed them already (reduce-scatter at each backward)."""
        if self.world_size == 1 or self.sharded:
            return
        for p in self.model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)

    # -- weights and checkpoints ---------------------------------------------------------------

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights with HF names, each in the dtype it was loaded in ([model] dtype: what the
        engines hold), cast from the float32 masters: the live tensors when the dtypes agree, or
        sharded (fsdp2) full CPU copies gathered collectively: every rank must call it, and only
        rank 0 gets any."""
        if self.sharded:
            yield from full_weights(self.model, self.weight_dtypes)
            return
        for name, tensor in self.model.state_dict().items():
            yield name, tensor.detach().to(self.weight_dtypes.get(name, tensor.dtype))

    # -- colocation --------------------------------------------------------------------------

    def offload(self) -> int:
        """Move the optimizer state to host memory; returns the bytes freed on the device (0 on
        CPU, where it already is)."""
        return self._move_optimizer_state(torch.device("cpu"))

    def onload(self) -> None:
        """Bring the optimizer state back to the training device before the next step."""
        self._move_optimizer_state(self.device)

    def _move_optimizer_state(self, target: torch.device) -> int:
        moved = 0
        for state in self.optimizer.state.values():
            for key, value in state.items():
                # AdamW keeps its step counter on the CPU unless capturable: leave it there.
                if key == "step" or not isinstance(value, torch.Tensor) or value.device == target:
                    continue
                if value.device.type != "cpu":
                    moved += value.numel() * value.element_size()
                state[key] = value.to(target)
        return moved

    def save_checkpoint(self, manager: CheckpointManager, state: ResumeState) -> Path:
        return manager.save(state.step, self.model, self.optimizer, state)

    def load_checkpoint(self, manager: CheckpointManager) -> ResumeState | None:
        return manager.load_latest(self.model, self.optimizer)
