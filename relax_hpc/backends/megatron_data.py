"""Where a Megatron trainer rank sits, which rows it trains on, and fixed-shape micro-batches.

Pure functions of sizes and tensors (no megatron import), so the rules are unit-tested in the
project venv (tests/backends/test_megatron_data.py).

Rank layout: megatron-core's default order ``tp-cp-ep-dp-pp`` puts tensor-parallel peers on
adjacent ranks, then context-parallel, then data-parallel replicas, then pipeline stages::

    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

(expert parallelism is folded into data parallelism for the dense layers, so it does not move
a rank). ``MegatronBackend`` checks this against ``parallel_state`` at start.

Rows: the transfer queue hands rows to whichever trainer rank asks, but all ranks of one model
replica (its tensor, context and pipeline peers) must train on the same rows. So only the first
rank of each replica (tp, cp and pp rank 0: ``reads_rows``) takes rows from the queue; it
broadcasts them to its peers (``MegatronBackend``), whose own row stream stays empty. Rows and
rewards are then counted once per replica.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from relax_hpc.backends.batch import TrainBatch


@dataclass(frozen=True)
class RankCoordinates:
    tensor: int
    context: int
    data: int
    pipeline: int


@dataclass(frozen=True)
class MegatronLayout:
    """How ``world_size`` trainer ranks split into tensor x context x data x pipeline groups."""

    world_size: int
    tensor: int = 1
    pipeline: int = 1
    context: int = 1
    expert: int = 1

    @property
    def model_parallel(self) -> int:
        return self.tensor * self.pipeline * self.context

    @property
    def data(self) -> int:
        return self.world_size // self.model_parallel

    def problems(self) -> list[str]:
        """Every reason these sizes cannot run, each naming its [train.megatron] key."""
        found = []
        if self.world_size % self.model_parallel:
            found.append(
                f"[train] num_processes = {self.world_size} is not a multiple of tensor_parallel x "
                f"pipeline_parallel x context_parallel = {self.tensor} x {self.pipeline} x "
                f"{self.context} = {self.model_parallel}; the data-parallel size is what is left, "
                "so choose sizes whose product divides num_processes"
            )
        elif self.data % self.expert:
            found.append(
                f"[train.megatron] expert_parallel = {self.expert} must divide the data-parallel "
                f"size {self.data} (num_processes / (tensor x pipeline x context))"
            )
        if self.context > 1:
            found.append(
                f"[train.megatron] context_parallel = {self.context}: not supported by this "
                "version (it needs Transformer Engine's attention and a sequence split this "
                "backend does not do yet); set context_parallel = 1"
            )
        return found

    def coordinates(self, rank: int) -> RankCoordinates:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside 0..{self.world_size - 1}")
        tensor, rest = rank % self.tensor, rank // self.tensor
        context, rest = rest % self.context, rest // self.context
        return RankCoordinates(tensor, context, rest % self.data, rest // self.data)

    def reads_rows(self, rank: int) -> bool:
        """Whether ``rank`` takes its replica's rows from the queue (the others get them from it)."""
        c = self.coordinates(rank)
        return c.tensor == 0 and c.context == 0 and c.pipeline == 0

    def row_source(self, rank: int) -> int:
        """The rank that reads the rows ``rank`` trains on."""
        c = self.coordinates(rank)
        return self.tensor * self.context * c.data


def check_layout(layout: MegatronLayout, *, sequence_parallel: bool, distributed_optimizer: bool,
                 device: str) -> None:
    """ValueError listing every [train.megatron] setting that cannot run here."""
    found = layout.problems()
    if sequence_parallel and layout.tensor == 1:
        found.append("[train.megatron] sequence_parallel = true needs tensor_parallel > 1")
    if distributed_optimizer and torch.device(device).type != "cuda":
        found.append(
            "[train.megatron] distributed_optimizer = true needs CUDA: on CPU the backend trains "
            "with torch.optim.AdamW (Megatron's optimizer is CUDA-only); set it to false"
        )
    if found:
        raise ValueError('[train] backend = "megatron" cannot run:\n  ' + "\n  ".join(found))


def pad_batch(batch: TrainBatch, rows: int, length: int, pad_id: int) -> TrainBatch:
    """``batch`` grown to ``rows`` rows of ``length`` tokens: pad tokens, nothing trained.

    Added cells carry the pad id, a zero attention and loss mask, zero log-probs and advantages,
    so they change no loss and no gradient (a causal model's earlier positions never see them).
    """
    have_rows, have_length = batch.input_ids.shape
    if rows < have_rows or length < have_length:
        raise ValueError(f"pad_batch cannot shrink [{have_rows}, {have_length}] to [{rows}, {length}]")

    per_token = length - 1

    def grow(t: torch.Tensor, columns: int | None, fill: float) -> torch.Tensor:
        shape = (rows,) if columns is None else (rows, columns)
        out = torch.full(shape, fill, dtype=t.dtype, device=t.device)
        out[tuple(slice(0, n) for n in t.shape)] = t
        return out

    def grow_optional(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else grow(t, per_token, 0)

    def grow_routes(t: torch.Tensor | None) -> torch.Tensor | None:
        # Added cells route to experts 0..k-1, as megatron_replay.pack_routes pads.
        if t is None:
            return None
        k = t.shape[-1]
        out = torch.arange(k, dtype=t.dtype, device=t.device).expand(rows, length, t.shape[2], k).clone()
        out[: t.shape[0], : t.shape[1]] = t
        return out

    return TrainBatch(
        grow(batch.input_ids, length, pad_id), grow(batch.attention_mask, length, 0),
        grow(batch.targets, per_token, pad_id), grow(batch.loss_mask, per_token, 0),
        grow(batch.rollout_log_probs, per_token, 0),
        grow(batch.advantages, None if batch.advantages.dim() == 1 else per_token, 0),  # [B] or GAE's [B, L-1]
        grow_optional(batch.old_log_probs), grow_optional(batch.ref_log_probs), grow_routes(batch.routed_experts),
    )


def empty_batch(pad_id: int, length: int = 2) -> TrainBatch:
    """One row of pad tokens with nothing trained: the pass of a replica without rows."""
    ids = torch.full((1, length), pad_id, dtype=torch.long)
    zeros = torch.zeros((1, length - 1), dtype=torch.float32)
    return TrainBatch(ids, torch.zeros_like(ids), ids[:, 1:].clone(), zeros, zeros.clone(),
                      torch.zeros(1, dtype=torch.float32))


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def split_micro_batches(batch: TrainBatch, size: int, pad_id: int, *, uniform: bool,
                        length_multiple: int = 1) -> list[TrainBatch]:
    """``batch`` in micro-batches of ``size`` rows (the last may be shorter).

    ``uniform``: every micro-batch has exactly ``size`` rows and the batch's length (pipeline
    stages exchange activations of one fixed shape per call). ``length_multiple``: the token
    length is rounded up to it (sequence parallelism splits the sequence over the TP ranks).
    """
    if size < 1:
        raise ValueError(f"micro-batch size {size} must be >= 1")
    length = round_up(batch.input_ids.shape[1], length_multiple)
    parts = []
    for start in range(0, len(batch), size):
        part = batch.slice(start, start + size)
        rows = size if uniform else len(part)
        if (rows, length) != tuple(part.input_ids.shape):
            part = pad_batch(part, rows, length, pad_id)
        parts.append(part)
    return parts


def concat_batches(batches: list[TrainBatch], pad_id: int) -> TrainBatch:
    """One batch of all rows of ``batches`` (right-padded to the longest); the optional per-token
    fields are kept only when every batch has them, as ``pack_rows`` does for its rows."""
    if not batches:
        raise ValueError("concat_batches needs at least one batch")
    length = max(b.input_ids.shape[1] for b in batches)
    grown = [pad_batch(b, len(b), length, pad_id) for b in batches]

    def cat(field: str) -> torch.Tensor | None:
        parts = [getattr(b, field) for b in grown]
        return None if any(p is None for p in parts) else torch.cat(parts)

    return TrainBatch(
        torch.cat([b.input_ids for b in grown]), torch.cat([b.attention_mask for b in grown]),
        torch.cat([b.targets for b in grown]), torch.cat([b.loss_mask for b in grown]),
        torch.cat([b.rollout_log_probs for b in grown]), torch.cat([b.advantages for b in grown]),
        cat("old_log_probs"), cat("ref_log_probs"), cat("routed_experts"),
    )
