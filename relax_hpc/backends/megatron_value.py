"""PPO's value model on megatron-core (``[critic] backend = "megatron"``, or unset under a Megatron actor).

The policy's Megatron GPT model (``megatron_model``: built from the HF directory by megatron-bridge,
split over the critic's ranks as ``[critic.megatron]`` says) with its output layer replaced by a
scalar value head (``ValueHead``) before Megatron's DDP wraps it. The decoder's last hidden states
are whole on every tensor-parallel rank (its row-parallel layers all-reduce their outputs), so the
head is one ``Linear(hidden, 1)`` replicated over them: every TP rank computes the same values and
the same loss, the backward through the decoder's parallel layers is the one of a single process,
and the head's gradient is the same on each (counted once in the gradient norm, as Megatron
counts replicated parameters). Like the torch critic (``value_model.ValueModel``) the head starts
at zero and the LM head is never evaluated.

``MegatronValueTrainer`` has the interface of ``value_model.ValueTrainer``: ``values`` of a
replica's rows, ``train`` on the clipped value loss (``relax_hpc.algos.gae.value_loss``) with the
whole step's token count as denominator, gradients summed over the data-parallel ranks
(``finalize_model_grads``), clipped and stepped by the backend's optimizer (``megatron_optim``:
float32 AdamW on CPU, Megatron's Adam on CUDA). The tensor-parallel peers of a replica take the
same rows (``data_rank`` / ``data_size``: its position among the replicas); only the first of them
writes the advantages (``writes_rows``). Sums over ranks are over the data-parallel group.

Checkpoints: ``step_N/critic/`` is megatron-core's dist_checkpointing of model and optimizer
(``megatron_ckpt.sharded_state``, which reshards on load), in the torch critic's step layout
(``value_model.save_step``: ``tmp_step_N`` renamed, ``critic.json`` last). Tensor and data
parallelism only: pipeline, context and expert parallelism and sequence parallelism are refused
(``layout_problems``). Tests: tests/backends/test_megatron_critic.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from relax_hpc.algos.aggregation import loss_denominator
from relax_hpc.backends.batch import TrainBatch
from relax_hpc.backends.megatron_model import build_model, make_provider, start_parallel_state
from relax_hpc.backends.megatron_optim import make_optimizer
from relax_hpc.backends.megatron_step import forward_logits
from relax_hpc.backends.value_model import ValueLossSums, ValueOptimConfig, save_step, saved_step
from relax_hpc.spec.schema import MegatronSpec

ADAM_BETAS = (0.9, 0.999)  # torch.optim.AdamW's, as the torch critic's


class ValueHead(torch.nn.Module):
    """GPTModel's output layer for a critic: hidden states ``[S, B, H]`` -> values ``[S, B, 1]``.
    Called as the output layer is (a weight to tie, a gather flag), and ignores both."""

    def __init__(self, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.value = torch.nn.Linear(hidden, 1, dtype=dtype)
        torch.nn.init.zeros_(self.value.weight)
        torch.nn.init.zeros_(self.value.bias)

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, None]:
        return self.value(hidden), None


def layout_problems(spec: MegatronSpec, world_size: int) -> list[str]:
    """What of ``[critic.megatron]`` the Megatron critic cannot run over ``world_size`` ranks."""
    found = []
    if world_size % spec.tensor_parallel:
        found.append(f"[critic] num_processes = {world_size} must be a multiple of [critic.megatron] "
                     f"tensor_parallel = {spec.tensor_parallel} (the data-parallel size is what is left)")
    for key in ("pipeline_parallel", "context_parallel", "expert_parallel"):
        if getattr(spec, key) != 1:
            found.append(f"[critic.megatron] {key} = {getattr(spec, key)}: the Megatron critic splits its "
                         "model by tensor parallelism only; set it to 1")
    if spec.sequence_parallel:
        found.append("[critic.megatron] sequence_parallel = true: the value head reads whole hidden states; "
                     "set it to false")
    if spec.distributed_optimizer:
        found.append("[critic.megatron] distributed_optimizer = true: the critic's optimizer state is not "
                     "sharded; set it to false")
    return found


class MegatronValueTrainer:
    """The critic's Megatron model and optimizer on one rank of the default process group."""

    def __init__(self, model_path: str, cfg: ValueOptimConfig, megatron: MegatronSpec, device: str = "cpu",
                 seed: int = 0, pad_id: int = 0) -> None:
        torch.manual_seed(seed)
        self.cfg, self.device, self.pad_id = cfg, torch.device(device), pad_id
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        found = layout_problems(megatron, self.world_size)
        if found:
            raise ValueError('[critic] backend = "megatron" cannot run:\n  ' + "\n  ".join(found))
        start_parallel_state(megatron, device, seed)
        try:
            bridge, provider = make_provider(model_path, megatron, dtype="float32", device=device)
        except RuntimeError as error:  # no megatron-bridge in this environment
            raise RuntimeError(str(error).replace('[train] backend = "megatron"', '[critic] backend = "megatron"')
                               ) from error
        hidden = int(provider.hidden_size)

        def attach_head(model: Any) -> None:
            model.output_layer = ValueHead(hidden, provider.params_dtype).to(self.device)

        self.built = build_model(bridge, provider, train=True, distributed_optimizer=False, prepare=attach_head)
        self.model = self.built.model
        self.optimizer = make_optimizer(self.model, lr=cfg.lr, betas=ADAM_BETAS, weight_decay=0.0,
                                        grad_clip=cfg.grad_clip, dtype=provider.params_dtype, device=device,
                                        distributed=False)
        from megatron.core import parallel_state as ps

        self._data_group = ps.get_data_parallel_group()
        self.data_rank, self.data_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.writes_rows = ps.get_tensor_model_parallel_rank() == 0
        self.sharded = megatron.tensor_parallel > 1

    @property
    def head(self) -> torch.nn.Linear:
        """The value head's ``Linear(hidden, 1)`` (the same tensors on every TP rank)."""
        return self.built.module.output_layer.value

    def _forward(self, micro: TrainBatch) -> torch.Tensor:
        """``[B, L-1]``: the value of each state before the next token (the shifted columns)."""
        return forward_logits(self.model, micro).squeeze(-1)[:, :-1]

    def _micro_batches(self, batch: TrainBatch) -> list[tuple[int, TrainBatch]]:
        size = self.cfg.micro_batch_size
        return [(start, batch.slice(start, start + size).to(self.device)) for start in range(0, len(batch), size)]

    def values(self, batch: TrainBatch | None) -> torch.Tensor | None:
        """``[B, L-1]`` float32 values of this replica's rows (as ``ValueTrainer.values``); None without rows."""
        if batch is None:
            return None
        self.model.eval()
        with torch.no_grad():
            out = [self._forward(micro).float().cpu() for _, micro in self._micro_batches(batch)]
        return torch.cat(out)

    def train(self, batch: TrainBatch | None, old_values: torch.Tensor | None,
              returns: torch.Tensor | None) -> dict[str, float]:
        """One optimizer step on the clipped value loss over every replica's rows (None: this
        replica has none this step and still takes part in the gradients' reduction)."""
        self.model.train()
        self.optimizer.zero_grad()
        local = 0.0 if batch is None else loss_denominator(batch.loss_mask, self.cfg.loss_agg)
        (denominator,) = self._sum_over_ranks([local])
        sums = ValueLossSums(self.cfg, max(denominator, 1.0))
        size = self.cfg.micro_batch_size
        if batch is not None and old_values is not None and returns is not None:
            for start, micro in self._micro_batches(batch):
                sums.backward(self._forward(micro), old_values[start:start + size], returns[start:start + size],
                              micro.loss_mask)
        self.built.provider.finalize_model_grads_func([self.model])  # summed over the data-parallel ranks
        return sums.stats(self._sum_over_ranks, self.optimizer.step())

    def sum_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        """`values` (float64, on CPU) summed over the replicas (the data-parallel ranks)."""
        if self.data_size == 1:
            return values
        wide = values.to(self.device, torch.float64)
        dist.all_reduce(wide, group=self._data_group)
        return wide.cpu()

    def _sum_over_ranks(self, values: list[float]) -> list[float]:
        return self.sum_over_ranks(torch.tensor(values, dtype=torch.float64)).tolist()

    def parameter_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    # -- checkpoints ---------------------------------------------------------------------------

    def save(self, root: Path, step: int, keep_last: int) -> Path:
        """``root/step_<step>/`` as the torch critic lays it out; every rank writes its pieces."""
        from megatron.core import dist_checkpointing

        from relax_hpc.backends.megatron_ckpt import sharded_state

        def write(directory: Path) -> None:
            directory.mkdir(exist_ok=True)  # every rank; dist_checkpointing wants it there
            dist_checkpointing.save(sharded_state(self.built.module, self.optimizer), str(directory))

        return save_step(root, step, keep_last, write, {"backend": "megatron"})

    def load(self, root: Path, step: int) -> None:
        """Restore the critic saved at `step` (any tensor-parallel size: dist_checkpointing reshards)."""
        from relax_hpc.backends.megatron_ckpt import read_checkpoint

        directory = saved_step(root, step)
        try:
            read_checkpoint(directory, None, self.built.module, self.optimizer)  # type: ignore[arg-type]
        except ValueError as error:
            raise ValueError(f"{error}; this critic runs [critic] backend = \"megatron\" and loads only "
                             "checkpoints the Megatron critic wrote") from error
