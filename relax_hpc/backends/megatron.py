"""The Megatron-core training backend (``[train] backend = "megatron"``).

The model is built from the HF directory by megatron-bridge and split over the trainer ranks as
``[train.megatron]`` says: tensor (TP), pipeline (PP) and expert (EP) parallel, sequence
parallel, recomputation; the data-parallel size (DP) is what is left (``megatron_data``). It
behaves like the torch backend, metric names included: the same losses (``relax_hpc.algos``) on
vocab-parallel logits (``megatron_step``), ``mini_batches`` optimizer steps per rollout batch,
each step the gradient of its whole batch (losses divided by the step's global token or sequence
count, gradients summed over DP ranks), gradient clipping, then AdamW (``megatron_optim``).

Rows: the first rank of each model replica takes that replica's rows (``reads_rows``; the trainer
role leaves the queue to it) and broadcasts them to its TP/PP peers. A step's stats are reduced
over the DP ranks on the last pipeline stage and broadcast to the stage's pipeline peers, so every
rank returns the same numbers.

``named_weights`` gathers whole HF-named tensors through the bridge (collective: every rank calls
it, rank 0 yields them), so with more than one rank the backend counts as ``sharded``.
Checkpoints use megatron-core's dist_checkpointing and reshard (``megatron_ckpt``).

Needs megatron-core 0.16.1 and megatron-bridge 0.3.1 (docs/backends.md); on CPU, the environment
of tools/setup-megatron-cpu. Tests: tests/backends/test_megatron_backend.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from relax_hpc.algos import LossInputs, LossSettings, opd_advantages, policy_loss
from relax_hpc.algos.aggregation import loss_denominator
from relax_hpc.backends import megatron_ckpt
from relax_hpc.backends.base import OptimSettings, StepStats, adam_betas
from relax_hpc.backends.batch import TrainBatch, pack_samples
from relax_hpc.backends.megatron_data import (
    MegatronLayout,
    check_layout,
    concat_batches,
    empty_batch,
    split_micro_batches,
)
from relax_hpc.backends.megatron_model import (
    BuiltModel,
    build_model,
    make_provider,
    start_parallel_state,
)
from relax_hpc.backends.megatron_optim import make_optimizer
from relax_hpc.backends.megatron_step import MicroBatch, run_schedule
from relax_hpc.ckpt import CheckpointManager, ResumeState
from relax_hpc.data.sample import Sample
from relax_hpc.models.hf import load_tokenizer
from relax_hpc.spec.schema import MegatronSpec


def refuse_multimodal(model_path: str | Path) -> None:
    """The Megatron backend builds the language model only (no vision or audio tower)."""
    from relax_hpc.models.hf import is_multimodal

    if (Path(model_path) / "config.json").is_file() and is_multimodal(model_path):
        raise ValueError(
            f"{model_path} is a multimodal model, and the Megatron backend has no vision or audio towers yet; "
            'set [train] backend = "torch" (with strategy = "fsdp2" to shard a large model) to train it '
            "(docs/multimodal.md)"
        )


class MegatronBackend:
    """A ``TrainBackend`` on megatron-core; see the module docstring."""

    def __init__(
        self, model_path: str | Path, optim: OptimSettings, loss: LossSettings, *, megatron: MegatronSpec,
        dtype: str = "float32", device: str = "cpu", temperature: float = 1.0,
        teacher_path: str | Path | None = None, opd_coef: float = 1.0, keep_reference: bool = True,
        seed: int = 0, routing_replay: bool = False,
    ) -> None:
        refuse_multimodal(model_path)
        self.device = torch.device(device)
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.layout = MegatronLayout(world, megatron.tensor_parallel, megatron.pipeline_parallel,
                                     megatron.context_parallel, megatron.expert_parallel)
        check_layout(self.layout, sequence_parallel=megatron.sequence_parallel,
                     distributed_optimizer=megatron.distributed_optimizer, device=device)
        self.routes = start_parallel_state(megatron, device, seed)
        self._check_rank_layout()
        self.spec, self.optim_cfg, self.loss_cfg = megatron, optim, loss
        self.temperature, self.opd_coef = temperature, opd_coef
        bridge, provider = make_provider(str(model_path), megatron, dtype=dtype, device=device,
                                         routing_replay=routing_replay)
        self.built = build_model(bridge, provider, train=True,
                                 distributed_optimizer=megatron.distributed_optimizer)
        # The frozen reference and teacher have the same layout as the model (inference only).
        self.reference: BuiltModel | None = None
        if loss.kl_coef > 0 and keep_reference:  # else a Reference role supplies ref_log_probs
            self.reference = build_model(bridge, provider, train=False, distributed_optimizer=False)
        self.teacher: BuiltModel | None = None
        if teacher_path is not None:
            t_bridge, t_provider = make_provider(str(teacher_path), megatron, dtype=dtype, device=device)
            self.teacher = build_model(t_bridge, t_provider, train=False, distributed_optimizer=False)
        self.optimizer = make_optimizer(
            self.built.model, lr=optim.lr, betas=adam_betas(optim), weight_decay=optim.weight_decay,
            grad_clip=optim.grad_clip, dtype=provider.params_dtype, device=device,
            distributed=megatron.distributed_optimizer)
        tokenizer = load_tokenizer(str(model_path))
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else tokenizer.eos_token_id)
        self.sharded = world > 1  # named_weights is a collective
        self.model_bytes = self._whole_model_bytes()
        self.reads_rows = self.layout.reads_rows(self.rank)

    def _check_rank_layout(self) -> None:
        from megatron.core import parallel_state as ps

        want = self.layout.coordinates(self.rank)
        got = (ps.get_tensor_model_parallel_rank(), ps.get_context_parallel_rank(),
               ps.get_data_parallel_rank(), ps.get_pipeline_model_parallel_rank())
        if got != (want.tensor, want.context, want.data, want.pipeline):
            raise RuntimeError(f"megatron placed rank {self.rank} at (tp, cp, dp, pp) = {got}, "
                               f"not {want}: megatron_data.MegatronLayout no longer matches it")

    # -- groups and rows -----------------------------------------------------------------------

    @staticmethod
    def _groups() -> tuple[Any, Any, Any]:
        from megatron.core import parallel_state as ps

        return ps.get_model_parallel_group(), ps.get_data_parallel_group(), ps.get_pipeline_model_parallel_group()

    @staticmethod
    def _is_last_stage() -> bool:
        from megatron.core import parallel_state as ps

        return bool(ps.is_pipeline_last_stage())

    def _share_rows(self, batch: TrainBatch | None) -> TrainBatch | None:
        """Every rank of a model replica gets the rows its first rank read (see the docstring)."""
        if self.layout.model_parallel == 1:
            return batch
        model_group = self._groups()[0]
        box = [None if batch is None else batch.to(torch.device("cpu"))]
        dist.broadcast_object_list(box, src=self.layout.row_source(self.rank), group=model_group)
        return box[0]

    def _from_last_stage(self, value: Any) -> Any:
        """``value`` of this pipeline's last stage, on every stage."""
        if self.layout.pipeline == 1:
            return value
        from megatron.core import parallel_state as ps

        box = [value]
        dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(),
                                   group=self._groups()[2])
        return box[0]

    def _sum_over_data(self, values: list[float]) -> list[float]:
        if self.layout.data == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=self._groups()[1])
        return t.tolist()

    def _names_over_data(self, names: Iterable[str]) -> list[str]:
        if self.layout.data == 1:
            return sorted(names)
        every: list[list[str] | None] = [None] * self.layout.data
        dist.all_gather_object(every, sorted(names), group=self._groups()[1])
        return sorted(set().union(*(n or [] for n in every)))

    def _micro_batches(self, batch: TrainBatch) -> list[TrainBatch]:
        multiple = self.spec.tensor_parallel if self.spec.sequence_parallel else 1
        return split_micro_batches(batch.to(self.device), self.optim_cfg.micro_batch_size, self.pad_id,
                                   uniform=self.layout.pipeline > 1, length_multiple=multiple)

    # -- log-probs -----------------------------------------------------------------------------

    def _forward_logprobs(self, built: BuiltModel, batch: TrainBatch | None) -> torch.Tensor | None:
        """Log-probs ``[B, L-1]`` of a replica's rows on its last pipeline stage; None elsewhere
        and without rows (a forward pass has no data-parallel collective)."""
        if batch is None:
            return None
        micro = [MicroBatch(m, routed_experts=m.routed_experts) for m in self._micro_batches(batch)]

        def keep(m: MicroBatch, logp: torch.Tensor, entropy: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
            return logp.sum() * 0.0, {"logp": logp.detach()}

        was_training = built.model.training
        built.model.eval()
        try:
            out = run_schedule(built.model, micro, keep, temperature=self.temperature, forward_only=True)
        finally:
            built.model.train(was_training)
        if not self._is_last_stage():
            return None
        rows, columns = batch.targets.shape
        return torch.cat([o["logp"] for o in out])[:rows, :columns].to(self.device)

    @torch.no_grad()
    def compute_log_probs(self, samples: list[Sample], reference: bool = False) -> list[list[float]]:
        """Per-token log-probs of each sample's response (every rank, the same samples)."""
        built = self.reference if reference else self.built
        if built is None:
            raise RuntimeError("no reference model: set [algorithm] kl_coef > 0 to keep one")
        logp = self._forward_logprobs(built, pack_samples(samples, self.pad_id))
        table = self._from_last_stage(None if logp is None else logp.cpu())
        out = []
        for i, s in enumerate(samples):
            p = len(s.prompt_ids)
            out.append(table[i, p - 1 : p - 1 + len(s.response_ids)].tolist())
        return out

    # -- training ------------------------------------------------------------------------------

    def train(self, samples: list[Sample]) -> dict[str, float]:
        return self.train_batch(pack_samples(samples, self.pad_id) if samples else None)

    def train_batch(self, batch: TrainBatch | None) -> dict[str, float]:
        """``mini_batches`` optimizer steps over this replica's rows (None: this rank has none,
        or is not the one that reads them)."""
        return self._train_rows(self._share_rows(batch), self.optim_cfg.mini_batches)

    def train_stream(self, micro_batches: Iterable[TrainBatch]) -> dict[str, float]:
        """One optimizer step over the stream's rows, collected first: the step's global count
        must be known before the schedule runs (the torch backend rescales afterwards instead)."""
        parts = list(micro_batches)
        batch = concat_batches(parts, self.pad_id) if parts else None
        return self._train_rows(self._share_rows(batch), 1)

    def _train_rows(self, batch: TrainBatch | None, mini: int) -> dict[str, float]:
        batch = None if batch is None else batch.to(self.device)
        rows = 0 if batch is None else len(batch)
        with torch.no_grad():  # fields from the ActorFwd / Reference roles win when present
            old = None if batch is None else batch.old_log_probs
            if old is None and mini > 1:  # with one step, each micro-batch's own detached logp
                old = self._forward_logprobs(self.built, batch)
            ref = None if batch is None else batch.ref_log_probs
            if ref is None and self.reference is not None:
                ref = self._forward_logprobs(self.reference, batch)
            teacher = None if self.teacher is None else self._forward_logprobs(self.teacher, batch)
        if batch is not None:
            batch = dataclasses.replace(batch, old_log_probs=old, ref_log_probs=ref)
        stats: dict[str, list[float]] = {}
        for k in range(mini):
            step = self._optimizer_step(batch, teacher, k * rows // mini, (k + 1) * rows // mini)
            for key, v in (step or {}).items():
                stats.setdefault(key, []).append(v)
        if not stats:
            raise RuntimeError("the training step received no rows; is rollout producing?")
        return {k: sum(v) / len(v) for k, v in stats.items()}

    def _optimizer_step(self, batch: TrainBatch | None, teacher: torch.Tensor | None, start: int,
                        stop: int) -> dict[str, float] | None:
        """One optimizer step on rows start..stop of this replica's rows (and the other replicas');
        None, and no step, when no replica has a row in it."""
        self.optimizer.zero_grad()
        local = 0.0 if batch is None or stop <= start else loss_denominator(
            batch.loss_mask[start:stop], self.loss_cfg.loss_agg)
        count, rows = self._sum_over_data([local, float(stop - start)])
        if rows == 0:
            return None
        denominator = max(count, 1.0)
        micro = self._step_micro_batches(batch, teacher, start, stop)
        step_stats = StepStats()

        def loss_fn(m: MicroBatch, logp: torch.Tensor, entropy: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
            b = m.batch
            advantages = b.advantages if m.teacher_log_probs is None else opd_advantages(
                b.advantages, logp.detach(), m.teacher_log_probs, b.loss_mask, self.opd_coef)
            inputs = LossInputs(
                logp=logp, old_logp=logp.detach() if b.old_log_probs is None else b.old_log_probs,
                advantages=advantages, mask=b.loss_mask, ref_logp=b.ref_log_probs,
                rollout_logp=b.rollout_log_probs, entropy=entropy,
            )
            loss, stats = policy_loss(self.loss_cfg, inputs, denominator)
            if m.trained:
                step_stats.add(stats, b.loss_mask)
            return loss, {}

        run_schedule(self.built.model, micro, loss_fn, temperature=self.temperature, forward_only=False)
        grad_norm = self.optimizer.step()
        reduced = None
        if self._is_last_stage():
            reduced = step_stats.reduce(self._sum_over_data, names=self._names_over_data(step_stats.sums))
        reduced = dict(self._from_last_stage(reduced))
        reduced["grad_norm"] = grad_norm
        return reduced

    def _step_micro_batches(self, batch: TrainBatch | None, teacher: torch.Tensor | None, start: int,
                            stop: int) -> list[MicroBatch]:
        """Rows start..stop as micro-batches; a replica without rows runs one empty pass, so the
        gradient reduction over data-parallel ranks pairs up."""
        if batch is None or stop <= start:
            multiple = self.spec.tensor_parallel if self.spec.sequence_parallel else 1
            return [MicroBatch(split_micro_batches(empty_batch(self.pad_id), 1, self.pad_id, uniform=True,
                                                   length_multiple=multiple)[0].to(self.device),
                               trained=False)]
        parts = self._micro_batches(batch.slice(start, stop))
        if teacher is None:
            return [MicroBatch(p, routed_experts=p.routed_experts) for p in parts]
        size = self.optim_cfg.micro_batch_size
        out = []
        for i, part in enumerate(parts):
            rows, columns = part.targets.shape
            t = teacher[start + i * size : min(start + (i + 1) * size, stop)]
            padded = torch.zeros(rows, columns, dtype=t.dtype, device=t.device)
            padded[: t.shape[0], : t.shape[1]] = t
            out.append(MicroBatch(part, teacher_log_probs=padded, routed_experts=part.routed_experts))
        return out

    # -- weights, checkpoints, colocation ------------------------------------------------------

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Whole tensors with HF names, gathered through the bridge: every rank must call it (and
        exhaust it); rank 0 gets the tensors, the others nothing."""
        config = self.built.provider
        if config.num_moe_experts and not config.moe_grouped_gemm:
            raise RuntimeError(
                "the megatron backend cannot export this mixture-of-experts model's weights to HF names: "
                "megatron-bridge 0.3.1 converts experts only in Transformer Engine's grouped-GEMM layout, and "
                "without Transformer Engine (as on CPU) they are one module per expert. Train MoE models with "
                "the megatron backend where Transformer Engine is installed (GPUs), or use backend = \"torch\"")
        for name, tensor in self.built.bridge.export_hf_weights([self.built.module], cpu=True,
                                                                show_progress=False):
            if self.rank == 0:
                yield name, tensor

    def save_checkpoint(self, manager: CheckpointManager, state: ResumeState) -> Path:
        return megatron_ckpt.save(manager, state, self.built.module, self.optimizer)

    def load_checkpoint(self, manager: CheckpointManager) -> ResumeState | None:
        return megatron_ckpt.load(manager, self.built.module, self.optimizer)

    def offload(self) -> int:
        """Optimizer state to host memory; the bytes freed on the device (0 on CPU)."""
        return self.optimizer.offload()

    def onload(self) -> None:
        self.optimizer.onload()

    def _whole_model_bytes(self) -> int:
        """The whole model's parameter bytes: this chunk's, summed over the tensor- and
        pipeline-parallel ranks, each replicated or shared parameter once (a collective)."""
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
        from megatron.core.transformer.module import param_is_not_shared

        local = sum(p.numel() * p.element_size() for p in self.built.model.parameters()
                    if param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p))
        total = torch.tensor(float(local), dtype=torch.float64, device=self.device)
        group = ps.get_model_parallel_group()
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(total, group=group)
        return int(total.item())

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """This rank's tensors by what they are for (relax_hpc/roles/memory.py): the model chunk's
        parameters, the gradient buffer (`main_grad`), the optimizer's masters and moments, and the
        reference's and teacher's chunks."""
        params = list(self.built.model.parameters())
        state = self.optimizer.state_tensors()
        return {
            "parameters": params,
            "gradients": [getattr(p, "main_grad", None) for p in params],
            "masters": state["masters"],
            "optimizer": state["optimizer"],
            "reference": list(self.reference.model.parameters()) if self.reference is not None else [],
            "teacher": list(self.teacher.model.parameters()) if self.teacher is not None else [],
        }
